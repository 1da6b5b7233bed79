"""Calibration of what a torch-codegen (CPU) host program pays per node (capabilities/ cannot import codegen/).

A torch-family program calls each node's reference implementation through
``codegen/host_support.ref``; on a small model that call's fixed cost, not the bytes it moves, is
most of a step, and it differs per op (a norm is five torch calls, an add one). So each common op
is timed through that same call at one token (its fixed cost: warm, and right after the caches were
swept as a large GEMM sweeps them) and at a cache-resident size (what grows with its bytes); the
same calls in one sequence give how much a program's mix costs over tight loops; the linear op's
decode GEMM curve is timed through the call too (replacing the bare ``torch.mm`` curve), and the
step state gives what ``run`` pays once per step. The cost model reads them (passes/cost_model_curves.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from portlayer.capabilities.calibrate_timing import Progress, Sizes, measure_s, sig
from portlayer.capabilities.descriptor import load_descriptor

FLUSH_BYTES = 8 * 2**20  # streamed before each cold call: past the core's own caches, as a large GEMM's weights are
SMALL = (1, 64)  # (tokens, hidden): the fixed cost of a call
BIG = (256, 512)  # cache-resident: 512 KiB per fp32 activation, so the sweep's cache-hot rate applies
TABLE_ROWS = 4096


def _cases(t: int, h: int) -> dict[str, tuple[list[Any], dict[str, Any], list[int]]]:
    """op -> (inputs, attrs, indices of inputs that are tables read by row: counted as the rows read)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(t, h, generator=g), torch.randn(t, h, generator=g)
    d = 64 if h >= 64 else h
    heads = h // d
    cache = torch.randn(TABLE_ROWS, d, generator=g)
    return {
        "rms_norm": ([x, torch.ones(h)], {}, []),
        "layer_norm": ([x, torch.ones(h), torch.zeros(h)], {}, []),
        "add": ([x, y], {}, []),
        "mul": ([x, y], {}, []),
        "silu": ([x], {}, []),
        "gelu": ([x], {}, []),
        "softmax": ([x], {}, []),
        "rope": ([x.view(t, heads, d), torch.arange(t), cache], {"rotary_dim": d, "head_dim": d}, [2]),
        "embedding": ([torch.randn(TABLE_ROWS, h, generator=g), torch.randint(0, TABLE_ROWS, (t,), generator=g)], {},
                      [0]),
        "index_select": ([x, torch.arange(0, t, max(1, t // 8))], {"dim": 0}, []),
    }  # fmt: skip


def _bytes(ins: list[Any], outs: list[torch.Tensor], tables: list[int]) -> int:
    out = sum(o.numel() * o.element_size() for o in outs)
    read = sum(x.numel() * x.element_size() for i, x in enumerate(ins) if isinstance(x, torch.Tensor) and i not in tables)
    return read + out * (1 + len(tables))


def measure_torch_nodes(dev: torch.device, sizes: Sizes, progress: Progress, base: str) -> dict[str, Any]:
    """{op: {us, bytes, big_us, big_bytes}} through host_support.ref, the linear curves through it, the step cost."""
    if load_descriptor(base).codegen != "torch" or dev.type != "cpu":
        return {}
    from portlayer.capabilities.calibrate_attention import paged_case
    from portlayer.codegen.host_support import StepState, ref
    from portlayer.flatten.ops import get_op

    progress.start(f"torch-family nodes through host_support.ref at {SMALL} and {BIG} (tokens, hidden)")
    table: dict[str, dict[str, Any]] = {}
    with torch.inference_mode():
        for size_key, (t, h) in (("", SMALL), ("big_", BIG)):
            st = StepState.build(None, t, dev, None)
            for op, (ins, attrs, tables) in _cases(t, h).items():
                full = get_op(op).complete_attrs(attrs)
                fn = lambda op=op, ins=ins, full=full, st=st: ref(op, ins, full, st)  # noqa: E731
                outs = fn()
                us = measure_s(fn, dev, sizes, sizes.budget_s / 2) * 1e6
                table.setdefault(op, {}).update({f"{size_key}us": sig(us), f"{size_key}bytes": _bytes(ins, outs, tables)})
                if not size_key:
                    table[op]["cold_us"] = sig(_cold_s(fn, sizes) * 1e6)
        # what run() pays once per step whatever the model: the step state from a decode's paged metadata
        _, ctx, _ = paged_case(1, 16, (1, 1, 8), torch.float32, dev)
        md, caches = ctx.attn_metadata, ctx.kv_cache
        step_us = measure_s(lambda: StepState.build(md, 1, dev, caches), dev, sizes, sizes.budget_s / 2) * 1e6
        seq_us, alone_us = _sequence_times(dev, sizes, ref, StepState.build(None, SMALL[0], dev, None), get_op)
        factor = max(1.0, seq_us / alone_us)
    progress.done(", ".join(f"{k} {v['us']:.3g}/{v['big_us']:.3g} (cold {v['cold_us']:.3g}) us" for k, v in table.items())
                  + f"; step state {step_us:.3g} us; called in sequence x{factor:.3g}")
    # both times, not their ratio: calibrate's rounds keep each time's best, then take the ratio of the two
    return {"torch_nodes": table, "torch_step_us": sig(step_us),
            "torch_sequence": {"sequence_us": sig(seq_us), "alone_us": sig(alone_us)},
            **_linear_curves(dev, sizes, progress, _ref_linear(dev))}


def _cold_s(fn: Callable[[], Any], sizes: Sizes) -> float:
    """Seconds per call when the caches were just swept (FLUSH_BYTES copied before each call, untimed): what a
    small op costs right after a large GEMM or attention streamed its bytes, code and data evicted alike."""
    import time

    from portlayer.capabilities.calibrate_timing import host_clock, trimmed

    src = torch.ones(FLUSH_BYTES // 8)
    dst = torch.empty_like(src)
    now = host_clock()[0]
    reps = []
    for _ in range(max(1, sizes.reps)):
        total, n, t_end = 0.0, 0, time.perf_counter() + sizes.budget_s / max(1, sizes.reps)
        while n < 1 or time.perf_counter() < t_end:
            dst.copy_(src)
            t0 = now()
            fn()
            total += now() - t0
            n += 1
        reps.append(total / n)
    return trimmed(reps)


def _sequence_times(dev: torch.device, sizes: Sizes, ref: Callable[..., Any], st: Any,
                    get_op: Callable[..., Any]) -> tuple[float, float]:
    """Microseconds of one-token calls one after another, as a program calls them, and the sum of each
    repeated in a tight loop (where its code and data stay in the core's caches). Their ratio (>= 1) is the
    sequence factor every warm fixed host cost of the torch family is scaled by.

    The order is a pre-norm decoder layer's (every architecture the compiler sees repeats one): norm, three
    projections, two norms, two ropes, the batched attention over a paged cache, a projection, a residual
    add, a norm, two projections, the activation, a product, a projection, a residual add."""
    from types import SimpleNamespace

    from portlayer.capabilities.calibrate_attention import paged_case
    from portlayer.codegen.torch_attention import attention_batched

    t, h = SMALL
    cases = _cases(t, h)
    w = torch.randn(h, h)

    def call(op: str) -> Callable[[], Any]:
        if op == "linear":
            ins, attrs = [torch.randn(t, h), w, None], {}
        else:
            ins, attrs, _ = cases[op]
        full = get_op(op).complete_attrs(attrs)
        return lambda: ref(op, ins, full, st)

    heads = (4, 2, 16)
    q_k_v, ctx, _ = paged_case(1, 128, heads, torch.float32, dev)
    ast = SimpleNamespace(meta=ctx.attn_metadata, kv_caches=ctx.kv_cache, workspace={})
    attn = lambda: attention_batched(*q_k_v, ast, layer=0, scale=0.25, causal=True, sliding_window=None)  # noqa: E731
    order = ["rms_norm", "linear", "linear", "linear", "rms_norm", "rms_norm", "rope", "rope", None, "linear", "add",
             "rms_norm", "linear", "linear", "silu", "mul", "linear", "add"]  # fmt: skip
    fns = [attn if op is None else call(op) for op in order]

    def seq() -> None:
        for fn in fns:
            fn()

    alone = {op: measure_s(fn, dev, sizes, sizes.budget_s / 4) for op, fn in zip(order, fns)}
    alone_total = sum(alone[op] for op in order)
    return measure_s(seq, dev, sizes, sizes.budget_s) * 1e6, alone_total * 1e6


def _ref_linear(dev: torch.device) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]:
    from portlayer.codegen.host_support import StepState, ref

    st = StepState.build(None, 1, dev, None)
    return lambda x, w, out: ref("linear", [x, w, None], {}, st)


def _linear_curves(dev: torch.device, sizes: Sizes, progress: Progress,
                   run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]) -> dict[str, Any]:
    from portlayer.capabilities.calibrate_gemm import measure_small_m

    small_k = max(64, sizes.gemm_k // 8)
    with torch.inference_mode():
        big = measure_small_m(dev, "fp32", sizes, progress, run=run, label="linear via host_support.ref")
        small = measure_small_m(dev, "fp32", sizes, progress, small_k, run=run, label="linear via host_support.ref")
    return {"gemm_curves": {"fp32": big}, "gemm_curves_small": {"fp32": small}, "gemm_small_k": small_k}
