"""Attention on the paged KV layout: what reading the cache through block tables costs.

Decode attention reads every cached key and value of every sequence once per layer; on the
paged layout that read goes through a block table. The benchmark runs the attention op over a
real paged cache at a few (batch, context) points and fits time = fixed + per sequence + bytes
/ bandwidth, the three terms the cost model needs. ``run`` defaults to the op's torch
implementation (what the torch codegen family executes); a backend may pass its own kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from portlayer.capabilities.calibrate_timing import Progress, Sizes, measure_s, sig
from portlayer.flatten.op_defs.attention import AttentionMetadata
from portlayer.flatten.ops import get_op

BLOCK = 16


def paged_case(batch: int, context: int, heads: tuple[int, int, int], dtype: torch.dtype,
               device: torch.device, cache_dtype: torch.dtype | None = None) -> tuple[list[torch.Tensor], Any, int]:
    """q/k/v of one decode token per sequence, a paged cache of ``context`` tokens each (in ``cache_dtype``, default
    ``dtype``: what the timed program's attention reads), and the KV bytes read."""
    hq, hkv, d = heads
    per = (context + 1 + BLOCK - 1) // BLOCK
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(batch * per, BLOCK, hkv, d, generator=g).to(device=device, dtype=cache_dtype or dtype)
    vc = torch.randn(batch * per, BLOCK, hkv, d, generator=g).to(device=device, dtype=cache_dtype or dtype)
    q = torch.randn(batch, hq, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(batch, hkv, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(batch, hkv, d, generator=g).to(device=device, dtype=dtype)
    md = AttentionMetadata.from_lens([1] * batch, device=device)
    md.seq_lens = torch.full((batch,), context + 1, dtype=torch.int32, device=device)
    md.max_seq_len = context + 1
    md.block_tables = torch.arange(batch * per, dtype=torch.int32, device=device).view(batch, per)
    md.slot_mapping = torch.tensor([(b * per + context // BLOCK) * BLOCK + context % BLOCK for b in range(batch)],
                                   dtype=torch.int64, device=device)
    ctx = SimpleNamespace(attn_metadata=md, kv_cache=[(kc, vc)])
    kv_bytes = 2 * batch * (context + 1) * hkv * d * kc.element_size()
    return [q, k, v], ctx, kv_bytes


def _reference_runner(heads: tuple[int, int, int]) -> Callable[[list[torch.Tensor], Any], Any]:
    hq, hkv, d = heads
    opdef = get_op("attention")
    attrs = opdef.complete_attrs({"num_heads": hq, "num_kv_heads": hkv, "head_dim": d, "scale": d**-0.5})
    return lambda ins, ctx: opdef.reference(ins, attrs, ctx)


def fit(points: list[dict[str, Any]]) -> dict[str, float]:
    """Least-squares time_us = fixed_us + per_seq_us * batch + kv_bytes / (gbps * 1e3), terms kept >= 0.

    In relative error (each row divided by its time): the points span 1000x in time, and in absolute
    error the largest one's noise would set the fixed cost that decides every small step."""
    w = torch.tensor([1.0 / max(p["us"], 1e-9) for p in points], dtype=torch.float64)[:, None]
    a = torch.tensor([[1.0, p["batch"], p["kv_bytes"]] for p in points], dtype=torch.float64)
    y = torch.tensor([p["us"] for p in points], dtype=torch.float64)
    coef = torch.linalg.lstsq(a * w, (y[:, None] * w)).solution[:, 0].clamp(min=0).tolist()
    if coef[2] <= 0:  # no bandwidth term resolved: attribute the largest point's time to its bytes
        big = max(points, key=lambda p: p["kv_bytes"])
        coef[2] = big["us"] / big["kv_bytes"]
    return {"fixed_us": sig(coef[0] + 1e-6), "per_seq_us": sig(coef[1] + 1e-6), "gbps": sig(1e-3 / coef[2])}


def measure_paged_attention(device: torch.device, sizes: Sizes, progress: Progress, dtype: torch.dtype,
                            run: Callable[[list[torch.Tensor], Any], Any] | None = None,
                            label: str = "torch attention op", graphed: bool = False,
                            cache_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Decode attention over a paged cache at ``sizes.attn_points``; the points and their fit.
    ``graphed``: timed from a replayed CUDA graph where capture works (device time, as a decode step runs)."""
    run = run or _reference_runner(sizes.attn_heads)
    points = []
    progress.start(f"paged attention ({label}) at (batch, context) {list(sizes.attn_points)}")
    with torch.inference_mode():
        for batch, context in sizes.attn_points:
            ins, ctx, kv_bytes = paged_case(batch, context, sizes.attn_heads, dtype, device, cache_dtype)
            fn = lambda ins=ins, ctx=ctx: run(ins, ctx)  # noqa: E731
            t = measure_s(fn, device, sizes, 2 * sizes.budget_s, 200, graphed=graphed)
            points.append({"batch": batch, "context": context, "kv_bytes": kv_bytes, "us": sig(t * 1e6),
                           "gbps": sig(kv_bytes / t / 1e9)})
    f = fit(points)
    progress.done(f"{f['gbps']:g} GB/s of KV, {f['per_seq_us']:g} us per sequence, {f['fixed_us']:g} us fixed")
    return {"kernel": label, "heads": list(sizes.attn_heads), "block_size": BLOCK,
            "dtype": str(dtype).removeprefix("torch."),
            "cache_dtype": str(cache_dtype or dtype).removeprefix("torch."), "points": points, **f}
