"""Calibration measures this device and writes a descriptor that says so (and says what it kept)."""

from __future__ import annotations

import json

import pytest
import torch

from portlayer.capabilities.calibrate import (
    SLOW_FRACTION,
    Sizes,
    calibrate,
    finish,
    measure_copy_bandwidth,
    measure_matmul,
)
from portlayer.capabilities.calibrate_attention import fit
from portlayer.capabilities.calibrate_memory import cache_knee, sweep_sizes
from portlayer.capabilities.calibrate_timing import CPU_QUICK, sig
from portlayer.capabilities.descriptor import Descriptor, load_descriptor, validate
from portlayer.capabilities.policy import ModelRequirements, negotiate

TINY = Sizes(copy_bytes=4 * 2**20, matmul_n=128, iters=2, warmup=1, launches=200, max_seconds_per_dtype=0.1, reps=1,
             gemm_k=256, gemm_ms=(1, 16), attn_points=((1, 32), (2, 32), (1, 128)), attn_heads=(4, 2, 16))  # fmt: skip


@pytest.fixture(scope="module")
def cpu_calibrated():
    return calibrate("cpu", sizes=TINY, threads=1)  # one thread: CPU time, no OpenMP waits on a loaded host


def test_cpu_calibration_validates_and_says_calibrated(cpu_calibrated):
    d = cpu_calibrated
    assert d["name"] == "cpu-x86_64-calibrated"
    assert d["memory"]["bandwidth_gbps"] > 0 and d["throughput_tflops"]["fp32"] > 0
    assert d["launch_overhead_us"] > 0
    for key in ("memory.bandwidth_gbps", "throughput_tflops.fp32", "launch_overhead_us", "memory.capacity_gb"):
        src = d["sources"][key]
        assert src.startswith("calibrated on ") and f"torch {torch.__version__}" in src and " at " in src
    shipped = load_descriptor("cpu-x86_64")
    assert d["sources"]["memory.alignment_bytes"] == (
        "kept from cpu-x86_64 (not measured): " + shipped.source("memory.alignment_bytes"))
    assert d["memory"]["alignment_bytes"] == shipped.raw["memory"]["alignment_bytes"]
    assert "Placeholder" not in d["notes"] and "not measured" in d["notes"]
    assert d["calibration"]["base_descriptor"] == "cpu-x86_64"
    assert Descriptor.from_dict(d, origin="calibration").compute_units.count >= 1


def test_curves_are_recorded(cpu_calibrated):
    cal = cpu_calibrated["calibration"]
    assert [r["bytes"] for r in cal["bandwidth_sweep"]] == sweep_sizes(TINY.copy_bytes)
    assert [r["m"] for r in cal["gemm_curves"]["fp32"]] == [1, 16]
    assert all(r["tflops"] > 0 and r["us"] > 0 for r in cal["gemm_curves"]["fp32"])
    attn = cal["attention"]
    assert [(p["batch"], p["context"]) for p in attn["points"]] == list(TINY.attn_points)
    assert attn["points"][0]["kv_bytes"] == 2 * 1 * 33 * 2 * 16 * 4  # k and v, context + new token, fp32
    assert attn["gbps"] > 0
    assert cal["launch_us"]["eager_us"] > 0 and cal["launch_us"]["graph_us"] is None  # no graphs on a CPU
    assert cal["launch_us"]["reference_op_us"] > 0


def test_emulated_dtypes_are_listed_absent(cpu_calibrated):
    tp = cpu_calibrated["throughput_tflops"]
    for k, v in cpu_calibrated["calibration"]["emulated_dtypes_tflops"].items():
        assert k not in tp and v < tp["fp32"] * SLOW_FRACTION


def _results(matmul: dict[str, float]) -> dict:
    sweep = [{"bytes": 2**20, "read_gbps": 9.0, "copy_gbps": 8.0}, {"bytes": 2**26, "read_gbps": 3.0, "copy_gbps": 2.5}]
    attn = {"points": [], "gbps": 1.0, "per_seq_us": 1.0, "fixed_us": 1.0}
    return {"sweep": sweep, "matmul": matmul, "gemm_curves": {}, "attention": attn,
            "launch": {"eager_us": 3.3333, "graph_us": None}}


def test_slow_dtype_is_absent_never_zero_and_validates():
    """The issue's case: round(x, 3) made a slow dtype 0.0, which the descriptor's own schema rejects."""
    raw = load_descriptor("cpu-x86_64").raw
    res = _results({"fp32": 0.000_412_34, "fp64": 0.000_2, "int8": 0.000_01, "bf16": 0.000_000_3})
    d = finish(raw, "cpu-x86_64", torch.device("cpu"), TINY, res)
    validate(d, origin="test")
    assert d["throughput_tflops"]["fp32"] == pytest.approx(0.0004123) and d["throughput_tflops"]["fp64"] == 0.0002
    assert "int8" not in d["throughput_tflops"] and "bf16" not in d["throughput_tflops"]  # absent, not 0
    assert d["calibration"]["emulated_dtypes_tflops"] == {"int8": 1e-05, "bf16": 3e-07}
    assert "throughput_tflops.int8" not in d["sources"]
    assert d["memory"]["bandwidth_gbps"] == 2.5 and d["calibration"]["cache_knee_bytes"] == 2**20


def test_significant_digits():
    assert sig(0.000_412_345) == 0.0004123 and sig(4268.54) == 4269.0 and sig(1e-9) > 0


def test_cache_knee_and_fit_on_synthetic_points():
    rows = [{"bytes": b, "read_gbps": g} for b, g in ((2**18, 40.0), (2**20, 35.0), (2**22, 12.0), (2**24, 10.0))]
    assert cache_knee(rows) == 2**20
    assert cache_knee(rows[-1:]) is None
    pts = [{"batch": b, "kv_bytes": n, "us": 5.0 + 2.0 * b + n / 4e3} for b, n in ((1, 4e5), (8, 4e5), (1, 4e6), (8, 4e6))]
    f = fit(pts)  # 4 GB/s = 4e3 bytes/us
    assert f["fixed_us"] == pytest.approx(5.0, rel=1e-3) and f["per_seq_us"] == pytest.approx(2.0, rel=1e-3)
    assert f["gbps"] == pytest.approx(4.0, rel=1e-3)


def test_calibrated_descriptor_drives_the_plan(cpu_calibrated, tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(cpu_calibrated))
    req = ModelRequirements.from_hf_config(
        {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100,
         "intermediate_size": 128}, name="toy")  # fmt: skip
    plan = negotiate(req, str(path))
    assert plan.target == "cpu-x86_64-calibrated"
    assert f"{cpu_calibrated['memory']['bandwidth_gbps']:g} GB/s" in plan.decision("prefill_chunk_size").reason


def test_measurements_are_plausible():
    dev = torch.device("cpu")
    assert 0.001 < measure_copy_bandwidth(dev, TINY) < 2000
    assert measure_matmul(dev, "tf32", TINY) is None  # tf32 is a GPU mode
    assert measure_matmul(dev, "fp8", TINY) is None


def test_quick_sizes_stay_small():
    assert CPU_QUICK.copy_bytes <= 256 * 2**20 and CPU_QUICK.matmul_n <= 1024


def test_calibrate_cli_writes_a_descriptor_with_progress(tmp_path, monkeypatch, capsys):
    import portlayer.capabilities.calibrate as cal
    from portlayer.capabilities.calibrate_timing import pinned_threads
    from portlayer.cli_capabilities import main

    monkeypatch.setattr(cal, "CPU_QUICK", TINY)
    out = tmp_path / "cpu.json"
    with pinned_threads(1):  # as OMP_NUM_THREADS=1 would: the CPU clock, and no OpenMP waits on a loaded host
        assert main(["calibrate", "--device", "cpu", "--quick", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("calibrate [")]
    assert any("bandwidth" in ln for ln in lines) and any("paged attention" in ln for ln in lines)
    assert any("launch latency (eager)" in ln for ln in lines) and "GB/s" in err
    assert any("paged attention (torch.sdpa" in ln for ln in lines)  # what the CPU program runs (backends extra)
    assert any("GEMM crossover" in ln and "not measured: cpu-x86_64 generates 'torch' code" in ln for ln in lines)
    assert load_descriptor(out).name == "cpu-x86_64-calibrated"
    cal = json.loads(out.read_text())["calibration"]
    assert cal["mode"] == "quick" and cal["threads"] == 1 and cal["clock"].startswith("process CPU time")
    # the torch family's nodes, timed through the call its programs make, and its GEMM curve through the linear op
    assert any("linear via host_support.ref" in ln for ln in lines)
    nodes = cal["torch_nodes"]
    assert {"rms_norm", "add", "rope", "embedding"} <= set(nodes)
    assert all(v["us"] > 0 and v["big_bytes"] > v["bytes"] > 0 for v in nodes.values())
    assert cal["torch_sequence_factor"] >= 1.0 and cal["launch_us"]["torch_step_us"] > 0


def test_crossover_is_the_leading_run_where_triton_wins():
    from portlayer.backends.calibration_runner import crossover

    pts = [{"m": m, "triton_us": t, "vendor_us": v} for m, t, v in ((1, 4.0, 6.0), (8, 5.0, 6.0), (32, 9.0, 7.0), (128, 5.0, 9.0))]
    assert crossover(pts) == 8  # the win at 128 after a loss at 32 does not extend the run
    assert crossover([{"m": 1, "triton_us": 7.0, "vendor_us": 6.0}]) == 0


def test_trimmed_keeps_the_fast_half():
    from portlayer.capabilities.calibrate_timing import trimmed

    assert trimmed([1.0, 1.1, 0.9, 50.0, 60.0]) == 1.0  # two slow spells change nothing
    assert trimmed([3.0]) == 3.0


def test_rounds_keep_each_numbers_best_round():
    from portlayer.capabilities.calibrate_rounds import merge_rounds, spread_pct

    a = {"sweep": [{"bytes": 4096, "copy_gbps": 10.0}], "matmul": {"fp32": 0.1}, "launch": {"eager_us": 5.0},
         "mode": "x", "attention": {"points": [{"batch": 1, "us": 80.0}]}}
    b = {"sweep": [{"bytes": 4096, "copy_gbps": 12.0}], "matmul": {"fp32": 0.08}, "launch": {"eager_us": 4.0},
         "mode": "y", "attention": {"points": [{"batch": 1, "us": 100.0}]}}
    m = merge_rounds([a, b])
    assert m["sweep"] == [{"bytes": 4096, "copy_gbps": 12.0}]  # a rate: the highest
    assert m["matmul"]["fp32"] == 0.1 and m["launch"]["eager_us"] == 4.0  # a time: the lowest
    assert m["attention"]["points"][0] == {"batch": 1, "us": 80.0} and m["mode"] == "x"
    assert spread_pct([a, b])["launch.eager_us"] == pytest.approx(100 * 1.0 / 4.5)


def test_cpu_clock_ignores_time_the_process_does_not_run():
    """One torch thread: the host clock is process CPU time, so a call that sleeps 20 ms costs ~0."""
    import time

    from portlayer.capabilities.calibrate_timing import host_clock, measure_s, pinned_threads

    before = torch.get_num_threads()
    with pinned_threads(1):
        assert host_clock()[0] is time.process_time and torch.get_num_threads() == 1
        assert measure_s(lambda: time.sleep(0.02), torch.device("cpu"), TINY, 0.05) < 0.005
    assert torch.get_num_threads() == before


def test_gemv_block_choices_match_every_row_count_and_stay_cheap_for_huge_limits():
    """The few-rows kernel's binaries: one per (BLOCK_M, BLOCK_K) gemv_blocks can pick. The GEMM crossover
    asks with a limit of 2**30 rows; looping over every row count stalled `calibrate` on the H200."""
    import time

    from portlayer.codegen.host_support import gemv_block_choices, gemv_blocks

    for rows in (1, 2, 3, 7, 8, 9, 33, 64, 100):
        for bk, least in ((512, 32), (4096, 32), (256, 128)):
            want = sorted({gemv_blocks(r, bk, least) for r in range(1, rows + 1)})
            assert [(c["BLOCK_M"], c["BLOCK_K"]) for c in gemv_block_choices(rows, bk, least)] == want
    t0 = time.perf_counter()
    assert len(gemv_block_choices(1 << 30, 4096)) == 31
    assert time.perf_counter() - t0 < 0.5


def test_the_eager_host_cost_is_the_line_through_each_chain_lengths_best_step():
    """Per-kernel eager host cost = the slope over chains of 1, 2, 4, 8 kernels (each length's best of its rounds:
    a slow spell only adds time), the one-kernel step its value at 1; a flat or falling line gives slope 0."""
    from portlayer.backends.calibration_runner import host_line

    pts = [(r, 30.0 + 20.0 * r) for r in (1, 2, 4, 8)] + [(2, 95.0), (8, 400.0)]  # two slow repeats
    step, per = host_line(pts)
    assert abs(per - 20.0) < 1e-9 and abs(step - 50.0) < 1e-9
    assert host_line([(1, 40.0), (2, 39.0), (4, 38.0)]) == (39.0, 0.0)


def test_the_crossover_chain_is_r_distinct_linears_past_the_caches_and_computes_their_product(tmp_path):
    """The GEMM crossover times a chain of K x K linears whose weights together pass the largest caches (one
    33.5 MB weight timed alone stays in a 50 MB L2); under the Triton interpreter, as the few-rows path (CUDA-core
    and tensor-core tiers) and the Triton GEMM path generate it, the chain equals torch's matmuls in float32."""
    import torch

    from portlayer.backends.calibration_runner import CHAIN_MIN_BYTES, _program, chain_length, chained_linears
    from portlayer.capabilities.descriptor import load_descriptor
    from portlayer.passes.pipeline import run_pipeline

    assert chain_length(4096, torch.bfloat16) * 4096 * 4096 * 2 >= CHAIN_MIN_BYTES > 256 << 20
    assert 2 <= chain_length(64, torch.bfloat16) <= 256 and chain_length(1 << 15, torch.bfloat16) == 2
    assert chain_length(1024, torch.bfloat16) * 1024 * 1024 * 2 >= CHAIN_MIN_BYTES
    k, r = 32, 3
    graph = chained_linears(k, r, torch.float32)
    ws = [graph.weights[f"w{i}"] for i in range(r)]
    assert len({w.data_ptr() for w in ws}) == r
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    want = x
    for w in ws:
        want = want @ w.T
    for name, gemm_rule, gemv_rule, dot_rule in (("gemv", 0, 64, 0), ("gemv_dot", 0, 1, 64), ("triton", 1 << 30, 0, 0)):
        prog = _program(run_pipeline, graph, load_descriptor("nvidia-h200"), torch.float32, torch.device("cpu"),
                        tmp_path / name, gemm_rule, gemv_rule, dot_rule)
        from portlayer.flatten.op_defs.attention import AttentionMetadata

        got = prog.run({"x": x}, AttentionMetadata.single(5, device=torch.device("cpu")), None)[0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_generated_attention_program_calibration_times_is_paged_decode_attention(tmp_path):
    """calibrate times decode attention for Triton targets through a generated one-attention program
    (backends/calibration_runner.one_attention); here that program, under the Triton interpreter in float32,
    on the calibration's own paged case, against torch SDPA over the cache's tokens plus the new K/V."""
    import torch
    import torch.nn.functional as F

    from portlayer.backends.calibration_runner import _program, one_attention
    from portlayer.capabilities.calibrate_attention import paged_case
    from portlayer.capabilities.descriptor import load_descriptor
    from portlayer.passes.pipeline import run_pipeline

    hq, hkv, d = heads = (4, 2, 16)
    batch, context = 2, 20
    cpu = torch.device("cpu")
    prog = _program(run_pipeline, one_attention(heads, torch.float32), load_descriptor("nvidia-h200"), torch.float32,
                    cpu, tmp_path / "attention", 0, 0)
    (q, k, v), ctx, _ = paged_case(batch, context, heads, torch.float32, cpu)
    kc, vc = (c.clone() for c in ctx.kv_cache[0])  # the cache before the program writes the new token
    out = prog.run({"q": q, "k": k, "v": v}, ctx.attn_metadata, ctx.kv_cache)[0]
    for b in range(batch):
        blocks = ctx.attn_metadata.block_tables[b].tolist()
        keys = torch.cat([kc[blocks].reshape(-1, hkv, d)[:context], k[b:b + 1]])  # [context + 1, hkv, d]
        vals = torch.cat([vc[blocks].reshape(-1, hkv, d)[:context], v[b:b + 1]])
        rep = hq // hkv
        want = F.scaled_dot_product_attention(q[b][:, None], keys.transpose(0, 1).repeat_interleave(rep, 0),
                                              vals.transpose(0, 1).repeat_interleave(rep, 0), scale=d**-0.5)
        torch.testing.assert_close(out[b], want[:, 0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layers", [1, 3])
def test_the_decode_step_program_graph_step_calibration_replays_is_paged_attention_over_embeddings(tmp_path, layers):
    """calibrate times the host cost of a replayed decode step with backends/calibration_runner.one_decode_step:
    a causal LM's three inputs (token ids, positions, the rows to return), ``layers`` paged attentions with a KV
    cache each, the rows gathered. Here its generated program, interpreted in float32 on the calibration's paged
    case, against torch SDPA layer by layer: layer 0's queries are the token's + its position's embeddings,
    layer i's the output of layer i-1; keys and values embed the token; the returned rows are the ones asked."""
    import torch
    import torch.nn.functional as F

    from portlayer.backends.calibration_runner import DECODE_INPUTS, _program, one_decode_step
    from portlayer.capabilities.calibrate_attention import paged_case
    from portlayer.capabilities.descriptor import load_descriptor
    from portlayer.passes.pipeline import run_pipeline

    hq, hkv, d = heads = (4, 2, 16)
    batch, context = 3, 18
    cpu = torch.device("cpu")
    graph = one_decode_step(heads, torch.float32, vocab=32, layers=layers, max_positions=64)
    assert [v.name for v in graph.inputs] == list(DECODE_INPUTS)
    tables = {n: t.clone() for n, t in graph.weights.items()}
    prog = _program(run_pipeline, graph, load_descriptor("nvidia-h200"), torch.float32, cpu, tmp_path / "step", 0, 0)
    _, ctx, _ = paged_case(batch, context, heads, torch.float32, cpu)
    g = torch.Generator().manual_seed(3)
    caches = [ctx.kv_cache[0]] + [tuple(torch.randn(c.shape, generator=g) for c in ctx.kv_cache[0])
                                  for _ in range(layers - 1)]
    before = [tuple(c.clone() for c in pair) for pair in caches]
    ids, pos, rows = torch.tensor([3, 31, 3]), torch.tensor([18, 18, 18]), torch.tensor([2, 0, 1])
    out = prog.run({"input_ids": ids, "positions": pos, "logits_indices": rows}, ctx.attn_metadata, caches)[0]
    assert out.shape == (batch, hq * d)
    x = tables["q_table"][ids] + tables["pos_table"][pos]
    for i, (kc, vc) in enumerate(before):
        q = x.view(batch, hq, d)
        k, v = (tables[f"{n}{i}_table"][ids].view(batch, hkv, d) for n in "kv")
        outs = []
        for b in range(batch):
            blocks = ctx.attn_metadata.block_tables[b].tolist()
            keys = torch.cat([kc[blocks].reshape(-1, hkv, d)[:context], k[b:b + 1]]).transpose(0, 1)
            vals = torch.cat([vc[blocks].reshape(-1, hkv, d)[:context], v[b:b + 1]]).transpose(0, 1)
            outs.append(F.scaled_dot_product_attention(q[b][:, None], keys.repeat_interleave(hq // hkv, 0),
                                                       vals.repeat_interleave(hq // hkv, 0), scale=d**-0.5)[:, 0])
        x = torch.stack(outs).reshape(batch, hq * d)
    torch.testing.assert_close(out, x[rows], rtol=1e-4, atol=1e-5)


def test_decode_gemm_curve_reads_a_different_weight_copy_each_call_when_asked():
    """Sizes.cold_bytes (GPU presets 512 MiB, CPU 256 MiB): the curve cycles through weight copies, so a weight is
    not timed from a cache it would never sit in during a decode step; a weight below cold_min_bytes (the CPU's
    small-K curve: the fixed cost of a call) and cold_bytes 0 keep one weight."""
    import dataclasses

    import torch

    from portlayer.capabilities.calibrate_gemm import measure_small_m
    from portlayer.capabilities.calibrate_timing import CPU_QUICK, GPU_QUICK, Progress

    assert GPU_QUICK.cold_bytes >= 256 << 20 and GPU_QUICK.cold_min_bytes == 0
    assert CPU_QUICK.cold_bytes >= 256 << 20 and CPU_QUICK.cold_min_bytes >= 1 << 20
    small_k = max(64, CPU_QUICK.gemm_k // 8)
    assert small_k * small_k * 4 < CPU_QUICK.cold_min_bytes <= CPU_QUICK.gemm_k ** 2 * 4  # small hot, big cold
    w = 64 * 64 * 4
    for cold, least, want in ((4 * w, 0, 4), (0, 0, 1), (4 * w, w, 4), (4 * w, w + 1, 1)):
        seen: list[int] = []

        def run(x, w, out, seen=seen):
            seen.append(w.data_ptr())
            return torch.mm(x, w.t(), out=out)

        sizes = dataclasses.replace(CPU_QUICK, cold_bytes=cold, cold_min_bytes=least, gemm_ms=(1, 2), reps=1,
                                    budget_s=0.01, warmup=1)
        rows = measure_small_m(torch.device("cpu"), "fp32", sizes, Progress(enabled=False), k=64, run=run)
        assert len(rows) == 2 and len(set(seen)) == want, (cold, least)


def test_skinny_gemm_shapes_are_timed_with_their_own_weight_and_output():
    """measure_aspects times a wide and a tall weight of the same K*N (the shapes of a model's projections);
    each point's TFLOP/s is 2*M*K*N over its own time (not the square's K*K)."""
    from portlayer.capabilities.calibrate_gemm import ASPECT, measure_aspects
    from portlayer.capabilities.calibrate_timing import Progress

    got = measure_aspects(torch.device("cpu"), "fp32", TINY, Progress(enabled=False))
    k = TINY.gemm_k // ASPECT
    assert [(a["k"], a["n"]) for a in got] == [(k, ASPECT * k), (ASPECT * k, k)]
    for a in got:
        assert [p["m"] for p in a["points"]] == list(TINY.gemm_ms)
        for p in a["points"]:
            assert p["tflops"] == pytest.approx(2 * p["m"] * a["k"] * a["n"] / (p["us"] * 1e-6) / 1e12, rel=0.01)
