"""memory plan: liveness, reuse, in place, alignment; the checker proves it and catches corruption."""

from __future__ import annotations

import copy

import pytest
from passes_samples import ctx_for

from portlayer.flatten.printer import canonical_text, parse_graph, print_graph
from portlayer.passes.memory_check import MemoryPlanError, check_memory_plan
from portlayer.passes.memory_plan import memory_plan
from portlayer.passes.pipeline import run_pipeline
from portlayer.passes.select import select

CHAIN = """
def forward(x: float32[num_tokens, 64]):
    # params:
    #   w1: float32[128, 64]
    #   w2: float32[64, 128]
    a = linear(x, w1, None)
    b = silu(a)
    c = linear(b, w2, None)
    d = mul(c, scalar=2.0)
    e = add(d, x)
    return e
"""


def _planned(text: str, target: str = "nvidia-h200", **options):
    g = parse_graph(text)
    ctx = ctx_for(g, target, memory_buckets=[512], **options)
    return memory_plan(select(g, ctx), ctx)


def test_memory_plan_ir_text_unchanged_and_buffers():
    out = _planned(CHAIN)
    assert print_graph(out) == canonical_text(CHAIN)  # the pass only annotates
    m = out.meta["memory_plan"]
    bufs = m["buffers"]
    assert m["alignment"] == 256
    assert bufs["a"] == {"offset": bufs["a"]["offset"], "size": "512*num_tokens", "start": 0, "end": 1}
    assert bufs["e"]["end"] == 5  # graph output lives to the end
    # b = silu(a) may write over a (a dies in b's kernel, same size, triton.pointwise allows it)
    assert bufs["b"]["inplace_of"] == "a" and bufs["b"]["offset"] == bufs["a"]["offset"]
    # c is live with b: disjoint; d in place of c; e in place of d
    assert bufs["d"]["inplace_of"] == "c" and bufs["e"]["inplace_of"] == "d"
    n = 512
    assert m["no_reuse_bytes"]["512"] == (128 + 128 + 64 + 64 + 64) * 4 * n
    assert m["peak_bytes"]["512"] == (128 + 64) * 4 * n  # b and c are the widest live pair
    assert check_memory_plan(m) > 0


def test_sizes_are_functions_of_num_tokens_and_aligned_on_ascend():
    text = CHAIN.replace("[128, 64]", "[96, 48]").replace("[64, 128]", "[48, 96]").replace("num_tokens, 64]", "num_tokens, 48]")
    out = _planned(text, "ascend-910b")
    m = out.meta["memory_plan"]
    assert m["alignment"] == 512
    assert m["buffers"]["c"]["size"] == "512*ceiling(3*num_tokens/8)"  # 192 B per token, rounded to 512
    assert all(b["offset"] % 512 == 0 for b in m["buffers"].values())


def test_checker_catches_corrupted_plans(captured):
    res = run_pipeline(captured["tiny-qwen3"], "nvidia-h200")
    m = res.graph.meta["memory_plan"]
    check_memory_plan(m)
    bufs = m["buffers"]
    # two buffers live at the same time: move one onto the other
    names = list(bufs)
    x, y = next((a, b) for i, a in enumerate(names) for b in names[i + 1:]
                if bufs[a]["start"] <= bufs[b]["end"] and bufs[b]["start"] <= bufs[a]["end"]
                and bufs[b].get("inplace_of") != a and bufs[a].get("inplace_of") != b)
    bad = copy.deepcopy(m)
    bad["buffers"][y]["offset"] = bad["buffers"][x]["offset"]
    with pytest.raises(MemoryPlanError, match=f"{x} .* and {y} .* overlap while both live|{y} .* and {x} .* overlap"):
        check_memory_plan(bad)
    misaligned = copy.deepcopy(m)
    misaligned["buffers"][x]["offset"] += 64
    with pytest.raises(MemoryPlanError, match="not a multiple of 256"):
        check_memory_plan(misaligned)
    stretched = copy.deepcopy(m)  # a buffer that lives longer than planned collides with its reuser
    victim = next(b for b, i in bufs.items() if any(o["offset"] == i["offset"] and o["start"] > i["end"] + 1
                                                     for o in bufs.values()))
    stretched["buffers"][victim]["end"] = len(res.graph.meta["kernels"])
    with pytest.raises(MemoryPlanError, match="overlap"):
        check_memory_plan(stretched)


def test_tiny_qwen3_prefill_512_peak_vs_no_reuse(captured):
    res = run_pipeline(captured["tiny-qwen3"], "nvidia-h200")
    m = res.graph.meta["memory_plan"]
    peak, flat = m["peak_bytes"]["512"], m["no_reuse_bytes"]["512"]
    assert peak <= 0.5 * flat, (peak, flat)
    assert m["live_lower_bound_bytes"]["512"] <= peak
    # the buffers really hold the values: every kernel output of the fused graph has a home
    homes = set(m["buffers"]) | {a for b in m["buffers"].values() for a in b.get("aliases", [])}
    for k in res.graph.meta["kernels"]:
        assert set(k["outputs"]) <= homes


def test_most_live_sweep_matches_brute_force():
    """The interval sweep gives what summing every live buffer at every kernel index gives."""
    import random

    from portlayer.passes.memory_plan import _most_live

    rng = random.Random(0)
    for _ in range(300):
        k = rng.randint(0, 30)
        bufs = {}
        for i in range(rng.randint(0, 20)):
            s = rng.randint(0, k)
            bufs[f"b{i}"] = {"start": s, "end": rng.randint(s, k)}
        sizes = {b: rng.randint(0, 1000) for b in bufs}
        brute = max((sum(sz for b, sz in sizes.items() if bufs[b]["start"] <= t <= bufs[b]["end"])
                     for t in range(k + 1)), default=0)
        assert _most_live(bufs, sizes, k) == brute
