"""The launch configs an autotuning search may try per kernel family, within what the descriptor allows.

Small on purpose (a handful per family, the default first): warps scaled by the warp size and
capped by threads per unit, pipeline stages within shared memory, GEMM tiles whose stages fit.
Row kernels (norms, embedding, rope, KV write) keep their block sizes, which the kernel needs to
cover a whole row; only their warps vary. Prefill attention keeps its BLOCK_N; decode attention varies
its tokens a step (TILE) and programs per unit (PROGRAMS: the splits). The few-rows
GEMM (gemv) varies its W-tile budget and programs per unit, from which it derives its blocks; the quantized
one without a norm (gemv_wq) its columns a program, its unrolled tiles and, where the device has programmatic
dependent launch, when the next kernel may launch (PDL_TRIGGER).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
GEMM_TILES = ((128, 128, 64), (128, 64, 64), (64, 128, 64), (64, 64, 64), (64, 64, 32), (32, 64, 64))


def _warps(default: int, warp: int, max_threads: int) -> list[int]:
    out = []
    for w in (default, default // 2, default * 2):
        if w >= 1 and w * warp <= min(1024, max_threads) and w not in out:
            out.append(w)
    return out


def _dedupe(cfgs: list[dict[str, int]]) -> list[dict[str, int]]:
    seen, out = set(), []
    for c in cfgs:
        k = tuple(sorted(c.items()))
        if k not in seen:
            seen.add(k)
            out.append(c)
    return out


def candidates(family: str, default: Mapping[str, int], descriptor: Any, dtype: str = "bfloat16",
               limit: int = 6) -> list[dict[str, int]]:
    """Configs to time for ``family``; the first is ``default``; every one names the same parameters."""
    base = dict(default)
    if not base:
        return []
    cu = descriptor.compute_units
    warp = int(descriptor.warp_size)
    smem = int(cu.max_shared_memory_per_block_bytes or cu.shared_memory_per_unit_bytes or 0)
    item = ITEMSIZE.get(dtype, 2)
    out = [base]
    if family == "gemm" and {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_stages", "num_warps"} <= set(base):
        for bm, bn, bk in GEMM_TILES:
            stage = (bm * bk + bk * bn) * item
            for stages in (base["num_stages"], 2, 3, 4):
                if stages * stage <= smem:
                    for w in (4, 8):
                        if w * warp <= cu.max_threads_per_unit:
                            out.append({**base, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_stages": stages, "num_warps": w})
                    break
    elif family == "attention_decode" and {"TILE", "PROGRAMS", "num_stages"} <= set(base):
        # a decode program streams one sequence's keys: the bytes a step has in flight (TILE, the K tile's elements;
        # V's the same) and how many programs share the device (PROGRAMS per unit: the splits) decide it
        t, p, w0, s0 = base["TILE"], base["PROGRAMS"], base["num_warps"], base["num_stages"]
        bd = base.get("BLOCK_D", 128)
        for c in ({"TILE": t * 2}, {"TILE": t // 2}, {"PROGRAMS": p * 2}, {"PROGRAMS": max(1, p // 2)},
                  *({"num_warps": w} for w in _warps(w0, warp, cu.max_threads_per_unit) if w != w0),
                  *({"num_stages": x} for x in (1, 2, 3) if x != s0)):
            cand = {**base, **c}
            if cand["TILE"] >= 16 * bd and cand["num_stages"] * 2 * cand["TILE"] * item <= smem:
                out.append(cand)
    elif family.startswith("attention") and "num_stages" in base:
        bd, bn = base.get("BLOCK_D", 128), base.get("BLOCK_N", 64)
        stage = (base.get("BLOCK_M", 0) * bd + 2 * bn * bd) * item  # Q tile (prefill) + K and V tiles
        for w in _warps(base["num_warps"], warp, cu.max_threads_per_unit):
            for s in (base["num_stages"], 1, 2, 3):
                if s == base["num_stages"] or s * stage <= smem:
                    out.append({**base, "num_warps": w, "num_stages": s})
    elif family == "gemv" and {"TILE", "PROGRAMS"} <= set(base):  # the kernel derives its blocks from these two
        # bigger W tiles first: at K ~ 1-3k a program streams its rows in 2-4 tiles, so the bytes each program
        # has in flight (not the warps) bound the read (H200 profile: 25-35% of bandwidth at TILE 4096)
        w0 = base.get("num_warps", 4)
        more = [w for w in _warps(w0, warp, cu.max_threads_per_unit) if w > w0]
        t, p = base["TILE"], base["PROGRAMS"]
        for tile, programs, w in ((t * 2, p, w0), (t * 4, p, w0), *((t * 4, p, x) for x in more),
                                  *((t * 2, p, x) for x in more), (t, p * 2, w0), (t // 2, p, w0),
                                  (t, max(1, p // 2), w0)):
            out.append({**base, "TILE": tile, "PROGRAMS": programs, "num_warps": w})
        out += [{**base, "num_warps": w} for w in _warps(w0, warp, cu.max_threads_per_unit)]
    elif family == "gemv_wq" and {"BLOCK_N", "UNROLL"} <= set(base):
        # the sub-group GEMV at one row waits on memory latency: the loads in flight (columns x unrolled tiles) and,
        # under programmatic dependent launch, when the next kernel may take the units (PDL_TRIGGER 1 / 2) decide it
        if "PDL_TRIGGER" in base and descriptor.has("programmatic_dependent_launch"):
            out.append({**base, "PDL_TRIGGER": 3 - base["PDL_TRIGGER"]})
        bn, unroll = base["BLOCK_N"], base["UNROLL"]
        out += [{**base, "BLOCK_N": bn * 2}, {**base, "BLOCK_N": max(1, bn // 2)}, {**base, "UNROLL": max(1, unroll // 2)}]
        out += [{**base, "num_warps": w} for w in _warps(base["num_warps"], warp, cu.max_threads_per_unit)]
    else:
        out += [{**base, "num_warps": w} for w in _warps(base.get("num_warps", 4), warp, cu.max_threads_per_unit)]
    from portlayer.capabilities.tuning import MAX_VALUE

    return _dedupe([c for c in out if all(0 < v <= MAX_VALUE for v in c.values())])[:limit]  # what a tuning file holds
