"""Cost model on synthetic descriptors: the predicted time follows bandwidth, FLOP/s, launches and KV bytes."""

from __future__ import annotations

import copy

import pytest
from ir_samples import HEAD_DIM, KV_HEADS, tiny_decoder

from portlayer.capabilities.descriptor import load_descriptor
from portlayer.passes.cost_model import format_predictions, predict, predict_steps
from portlayer.passes.cost_model_curves import Curves
from portlayer.passes.pipeline import run_pipeline


@pytest.fixture(scope="module")
def cpu():
    return run_pipeline(tiny_decoder(tied=False), "cpu-x86_64")


@pytest.fixture(scope="module")
def gpu():
    return run_pipeline(tiny_decoder(tied=False), "nvidia-h200")


@pytest.fixture(scope="module")
def gpu_eager():
    """The H200 plan without step graphs: a prefill launches its kernels eagerly."""
    return run_pipeline(tiny_decoder(tied=False), "nvidia-h200", overrides={"step_graph_tokens": []})


def synthetic(name: str, bandwidth: float = 100.0, tflops: float = 1e6, launch: float = 1e-9) -> dict:
    raw = copy.deepcopy(dict(load_descriptor(name).raw))
    raw["memory"]["bandwidth_gbps"] = bandwidth
    raw["throughput_tflops"] = {k: tflops for k in raw["throughput_tflops"]}
    raw["launch_overhead_us"] = launch
    raw.pop("calibration", None)
    return raw


def test_doubling_bandwidth_halves_memory_bound_time(cpu, gpu_eager):
    for res, name in ((cpu, "cpu-x86_64"), (gpu_eager, "nvidia-h200")):
        t1 = predict(res.graph, res.plan, synthetic(name, bandwidth=50.0), "prefill", tokens=8)
        t2 = predict(res.graph, res.plan, synthetic(name, bandwidth=100.0), "prefill", tokens=8)
        assert t2.ms == pytest.approx(t1.ms / 2, rel=1e-6)
        assert {g.bound for g in t1.groups} <= {"memory", "attention"}


def test_doubling_tflops_halves_compute_bound_time(cpu):
    t1 = predict(cpu.graph, cpu.plan, synthetic("cpu-x86_64", bandwidth=1e9, tflops=1e-3), "prefill", tokens=4096)
    t2 = predict(cpu.graph, cpu.plan, synthetic("cpu-x86_64", bandwidth=1e9, tflops=2e-3), "prefill", tokens=4096)
    assert t2.ms == pytest.approx(t1.ms / 2, rel=1e-6)
    assert any(g.bound == "compute" for g in t1.groups)


def test_launch_bound_step_is_launches_times_overhead(cpu):
    raw = synthetic("cpu-x86_64", bandwidth=1e12, tflops=1e9, launch=10.0)
    p = predict(cpu.graph, cpu.plan, raw, "decode", batch=1, context=16)
    from portlayer.flatten.ops import get_op

    compute_nodes = sum(1 for n in cpu.graph.nodes if get_op(n.op).kind != "view")  # the torch host calls each
    assert p.launches == compute_nodes
    assert p.ms == pytest.approx(compute_nodes * 10.0 / 1e3, rel=1e-3)


def test_gemm_bytes_are_weights_plus_rows(cpu):
    """Independent count from the weight tensors: each linear reads its [N, K] weight, M x K in, writes M x N."""
    p = predict(cpu.graph, cpu.plan, synthetic("cpu-x86_64"), "decode", batch=3, context=8)
    want = 0
    for n in cpu.graph.nodes:
        if n.op == "linear":
            w = cpu.graph.weights[n.inputs[1]]
            n_out, k = w.shape
            want += w.numel() * w.element_size() + 3 * k * 4 + 3 * n_out * 4  # float32 activations, batch 3
    got = sum(g.bytes for g in p.groups if g.family == "gemm")
    assert got == want


def test_decode_kv_read_grows_with_context(gpu):
    raw = synthetic("nvidia-h200", bandwidth=1.0)  # slow enough that the attention kernel is above the launch floor
    short = predict(gpu.graph, gpu.plan, raw, "decode", batch=4, context=500)
    long = predict(gpu.graph, gpu.plan, raw, "decode", batch=4, context=1500)
    assert gpu.plan.kv_cache_dtype == "bfloat16"
    kv_bytes = 4 * 1000 * KV_HEADS * 2 * HEAD_DIM * 2  # 1000 more tokens, k and v, bf16 cache
    assert long.ms - short.ms == pytest.approx(kv_bytes / 1.0 / 1e6, rel=1e-6)
    fp8 = run_pipeline(tiny_decoder(tied=False), "nvidia-h200", overrides={"kv_cache_dtype": "float8_e4m3fn"})
    short = predict(fp8.graph, fp8.plan, raw, "decode", batch=4, context=500)
    long = predict(fp8.graph, fp8.plan, raw, "decode", batch=4, context=1500)
    assert long.ms - short.ms == pytest.approx(kv_bytes / 2 / 1.0 / 1e6, rel=1e-6)  # half the bytes


def test_graph_replay_only_for_captured_decode_batches(gpu, cpu):
    raw = synthetic("nvidia-h200")
    sizes = gpu.plan.value("graph_capture_sizes")
    assert predict(gpu.graph, gpu.plan, raw, "decode", batch=1).graphs
    assert not predict(gpu.graph, gpu.plan, raw, "decode", batch=max(sizes) + 1).graphs
    assert not predict(cpu.graph, cpu.plan, synthetic("cpu-x86_64"), "decode", batch=1).graphs


def test_a_prefill_up_to_the_largest_step_graph_bucket_replays_one_padded_to_its_bucket(gpu, gpu_eager):
    """Plan step_graph_tokens (codegen/step_graphs.py): a prefill of T tokens replays the graph of the smallest
    bucket >= T, whose GEMMs run on the padded rows; past the largest bucket the step is eager."""
    raw = synthetic("nvidia-h200", bandwidth=1e3, tflops=1e-3)  # compute-bound: time grows with the padded rows
    buckets = gpu.plan.value("step_graph_tokens")
    assert buckets and 100 not in buckets and 128 in buckets
    p100, p128 = (predict(gpu.graph, gpu.plan, raw, "prefill", tokens=t) for t in (100, 128))
    assert p100.graphs and p128.graphs and p100.host_ms == 0.0
    linear = [g.us for g in p100.groups if g.bound == "compute"]
    assert linear and linear == [g.us for g in p128.groups if g.bound == "compute"]
    assert not predict(gpu.graph, gpu.plan, raw, "prefill", tokens=max(buckets) + 1).graphs
    assert not predict(gpu_eager.graph, gpu_eager.plan, raw, "prefill", tokens=16).graphs


def test_calibrated_curves_are_read():
    raw = synthetic("cpu-x86_64")
    raw["calibration"] = {
        "bandwidth_sweep": [{"bytes": 2**20, "copy_gbps": 20.0}, {"bytes": 2**26, "copy_gbps": 5.0}],
        "gemm_curves": {"fp32": [{"m": 1, "us": 100.0}, {"m": 64, "us": 400.0}]}, "gemm_k": 1024,
        "launch_us": {"eager_us": 7.0, "graph_us": None},
        "attention": {"fixed_us": 3.0, "per_seq_us": 2.0, "gbps": 4.0},
    }  # fmt: skip
    c = Curves.from_descriptor(raw)
    assert c.calibrated and c.launch_us == 7.0
    assert c.memory_us(2**26) == pytest.approx(2**26 / 5e3)
    assert c.memory_us(2**20) == pytest.approx(2**20 / 20e3)
    assert c.memory_us(2**30) == pytest.approx(2**30 / 5e3)  # beyond the sweep: the largest set's bandwidth
    big_bw = synthetic("cpu-x86_64", bandwidth=1e9)
    big_bw["calibration"] = raw["calibration"]
    c = Curves.from_descriptor(big_bw)
    assert c.gemm_us(64, 1024, 1024, flops=0, nbytes=0, dtype="float32") == pytest.approx(400.0)
    assert c.gemm_us(128, 1024, 1024, flops=0, nbytes=0, dtype="float32") == pytest.approx(800.0)  # linear past M=64
    t = c.attention_us(batch=2, kv_bytes=8000, flops=0, dtype="float32", torch_family=True)
    assert t == pytest.approx(3.0 + 2 * 2.0 + 8000 / 4e3, rel=1e-6)


def test_predictions_print_steps_families_and_layers(cpu):
    text = format_predictions(predict_steps(cpu.graph, cpu.plan, synthetic("cpu-x86_64", launch=5.0)))
    for want in ("decode   batch   1", "decode   batch  64", "prefill   128 tok", "per family (ms)", "per layer (ms)"):
        assert want in text


def test_graph_without_kernels_is_refused(cpu):
    g = tiny_decoder()
    with pytest.raises(ValueError, match="run the pass pipeline"):
        predict(g, cpu.plan, synthetic("cpu-x86_64"))


def test_torch_attention_scales_per_sequence_through_the_sweep():
    raw = synthetic("cpu-x86_64")
    sweep = [{"bytes": 4096, "copy_gbps": 0.4}, {"bytes": 2**20, "copy_gbps": 20.0}, {"bytes": 2**26, "copy_gbps": 5.0}]
    base = Curves.from_descriptor({**raw, "calibration": {"bandwidth_sweep": sweep}})
    pts = [{"batch": b, "kv_bytes": b * n, "us": b * 3.0 * base.memory_us(n)} for b, n in ((1, 8192), (8, 8192), (2, 2**19))]
    c = Curves.from_descriptor({**raw, "calibration": {"bandwidth_sweep": sweep, "attention": {"points": pts}}})
    assert c.ops_per_sequence() == pytest.approx(3.0)
    t = c.attention_us(batch=5, kv_bytes=5 * 50_000, flops=0, dtype="float32", torch_family=True)
    assert t == pytest.approx(5 * 3.0 * base.memory_us(50_000))


def test_gemm_splits_fixed_and_proportional_cost_from_two_sizes():
    raw = synthetic("cpu-x86_64", bandwidth=1e9)
    # synthetic device: a GEMM costs 50 us + 1e-4 us per weight element at M = 1
    cal = {"gemm_k": 1024, "gemm_small_k": 128,
           "gemm_curves": {"fp32": [{"m": 1, "us": 50 + 1e-4 * 1024**2}]},
           "gemm_curves_small": {"fp32": [{"m": 1, "us": 50 + 1e-4 * 128**2}]}}  # fmt: skip
    c = Curves.from_descriptor({**raw, "calibration": cal})
    assert c.gemm_us(1, 64, 128, flops=0, nbytes=0, dtype="float32") == pytest.approx(50 + 1e-4 * 64 * 128)
    assert c.gemm_us(1, 4096, 4096, flops=0, nbytes=0, dtype="float32") == pytest.approx(50 + 1e-4 * 4096**2)


def test_skinny_vendor_gemms_take_the_measured_ratio_to_the_square_curves_by_aspect():
    """The square curves say 50 us + 1e-4 us per weight element; the wide shape (K=1024, N=4096) was measured
    at 1.2x that and the tall one (4096, 1024) at 1.5x: the calibrated shapes get their measured time, a
    shape half as skinny (aspect 2, log scale) half the excess, a skinnier one the full ratio, a square none."""
    raw = synthetic("nvidia-h200", bandwidth=1e9)

    def fit(kn):
        return 50 + 1e-4 * kn

    cal = {"gemm_k": 4096, "gemm_small_k": 512,
           "gemm_curves": {"bf16": [{"m": 64, "us": fit(4096**2)}]},
           "gemm_curves_small": {"bf16": [{"m": 64, "us": fit(512**2)}]},
           "gemm_aspects": [{"k": 1024, "n": 4096, "points": [{"m": 64, "us": 1.2 * fit(1024 * 4096)}]},
                            {"k": 4096, "n": 1024, "points": [{"m": 64, "us": 1.5 * fit(1024 * 4096)}]}]}  # fmt: skip
    c = Curves.from_descriptor({**raw, "calibration": cal})

    def us(k, n):
        return c.gemm_us(64, k, n, flops=0, nbytes=0, dtype="bfloat16")

    assert us(1024, 4096) == pytest.approx(1.2 * fit(1024 * 4096))
    assert us(4096, 1024) == pytest.approx(1.5 * fit(1024 * 4096))
    assert us(2048, 2048) == pytest.approx(fit(2048**2))
    assert us(2048, 1024) == pytest.approx(1.25 * fit(2048 * 1024))
    assert us(1024, 8192) == pytest.approx(1.2 * fit(1024 * 8192))
    no_aspects = Curves.from_descriptor({**raw, "calibration": {k: v for k, v in cal.items() if k != "gemm_aspects"}})
    assert no_aspects.gemm_us(64, 4096, 1024, flops=0, nbytes=0, dtype="bfloat16") == pytest.approx(fit(4096 * 1024))


def test_generated_gemm_paths_use_their_crossover_timings():
    raw = synthetic("nvidia-h200", bandwidth=1e9)
    raw["tuning"] = {"gemv_max_tokens": 4, "triton_gemm_max_tokens": 0}
    raw["calibration"] = {"gemm_crossover": {"k": 1024, "points": [
        {"m": 1, "triton_us": 9.0, "vendor_us": 6.0, "gemv_us": 3.0},
        {"m": 64, "triton_us": 12.0, "vendor_us": 10.0}]}}  # fmt: skip
    c = Curves.from_descriptor(raw)
    assert c.gemm_us(1, 1024, 1024, 0, 0, "bfloat16", path="gemv") == pytest.approx(3.0)
    assert c.gemm_us(1, 2048, 1024, 0, 0, "bfloat16", path="triton") == pytest.approx(18.0)  # scaled by K*N
    from portlayer.passes.cost_model import _gemm_path  # codegen/gemm_rule.py's thresholds

    assert _gemm_path(raw, {"impl": "triton.gemm"}, 4, False) == "gemv"
    assert _gemm_path(raw, {"impl": "triton.gemm"}, 8, False) == "vendor"  # triton_gemm_max_tokens 0
    assert _gemm_path(raw, {"impl": "triton.gemm_wq"}, 8, False) == "triton"  # quantized: always generated
    assert _gemm_path(raw, {"impl": "torch.linear"}, 1, True) == "vendor"


def test_batched_sdpa_attention_uses_the_fit():
    raw = synthetic("cpu-x86_64")
    sweep = [{"bytes": 4096, "copy_gbps": 0.4}, {"bytes": 2**26, "copy_gbps": 5.0}]
    attn = {"kernel": "torch.sdpa, codegen/torch_attention.py", "fixed_us": 30.0, "per_seq_us": 4.0, "gbps": 2.0,
            "points": [{"batch": 1, "kv_bytes": 4096, "us": 50.0}]}  # fmt: skip
    c = Curves.from_descriptor({**raw, "calibration": {"bandwidth_sweep": sweep, "attention": attn}})
    t = c.attention_us(batch=8, kv_bytes=16_000, flops=0, dtype="float32", torch_family=True)
    assert t == pytest.approx(30.0 + 8 * 4.0 + 16_000 / 2e3)


def test_torch_node_cost_grows_along_the_sweep():
    raw = synthetic("cpu-x86_64")
    flat = [{"bytes": 1000, "copy_gbps": 1.0}, {"bytes": 10**7, "copy_gbps": 1.0}]  # 1 GB/s: time linear in bytes
    nodes = {"mul": {"us": 10.0, "bytes": 1000, "big_us": 110.0, "big_bytes": 101_000}}
    c = Curves.from_descriptor({**raw, "calibration": {"bandwidth_sweep": flat, "torch_nodes": nodes}})
    assert c.torch_node_us("mul", "pointwise", 51_000) == pytest.approx(10.0 + 100.0 * 50_000 / 100_000)
    assert c.torch_node_us("sub", "pointwise", 1000) == pytest.approx(10.0)  # uncalibrated: its kind's stand-in
    twice = Curves.from_descriptor({**raw, "calibration": {"bandwidth_sweep": flat, "torch_nodes": nodes,
                                                           "torch_sequence_factor": 2.0}})  # fmt: skip
    assert twice.torch_node_us("mul", "pointwise", 51_000) == pytest.approx(20.0 + 50.0)  # only the fixed part scales
    assert Curves.from_descriptor(raw).torch_node_us("mul", "pointwise", 1000) is None


def test_torch_family_step_is_the_sum_of_its_calibrated_calls(cpu):
    """Per-op calibration: every compute node costs its op's call, GEMMs their curve, attention the fit, plus
    one step state; the counts come from the graph, independently of the cost model."""
    from portlayer.flatten.ops import get_op

    raw = synthetic("cpu-x86_64", bandwidth=1e9)
    ops = {n.op for n in cpu.graph.nodes}
    cal = {"bandwidth_sweep": [{"bytes": 4096, "copy_gbps": 1e9}, {"bytes": 2**26, "copy_gbps": 1e9}],
           "torch_nodes": {op: {"us": 7.0, "bytes": 100, "big_us": 7.0, "big_bytes": 10**6} for op in ops},
           "gemm_k": 1024, "gemm_small_k": 128, "gemm_curves": {"fp32": [{"m": 1, "us": 20.0}]},
           "gemm_curves_small": {"fp32": [{"m": 1, "us": 20.0}]}, "launch_us": {"torch_step_us": 5.0},
           "attention": {"kernel": "torch.sdpa, codegen/torch_attention.py", "fixed_us": 30.0, "per_seq_us": 0.0,
                         "gbps": 1e9, "points": []}}  # fmt: skip
    p = predict(cpu.graph, cpu.plan, {**raw, "calibration": cal}, "decode", batch=1, context=16)
    kinds = [get_op(n.op).kind for n in cpu.graph.nodes if get_op(n.op).kind != "view"]
    n_gemm, n_attn = kinds.count("gemm"), kinds.count("attention")
    expected = 7.0 * (len(kinds) - n_gemm - n_attn) + 20.0 * n_gemm + 30.0 * n_attn + 5.0
    assert n_gemm and n_attn
    assert p.ms * 1e3 == pytest.approx(expected, rel=1e-3)


def test_generated_gemv_timed_at_two_sizes_is_a_fixed_cost_plus_a_part_growing_with_the_weight():
    """Calibration times the few-rows kernel at K = N = 4096 and 512: a 1024x2048 decode GEMV is mostly the
    fixed cost (the H200 measured ~4 us where bytes / bandwidth says ~1), so both sizes come back exactly and
    a size between lies on the line through them in K*N."""
    raw = synthetic("nvidia-h200", bandwidth=4000.0)
    big, small = {1: 12.0, 8: 14.0}, {1: 3.0, 8: 3.5}
    raw["calibration"] = {"gemm_crossover": {"k": 4096, "k_small": 512,
                                             "points": [{"m": m, "triton_us": 50.0, "vendor_us": 20.0, "gemv_us": us}
                                                        for m, us in big.items()],
                                             "points_small": [{"m": m, "triton_us": 9.0, "gemv_us": us}
                                                              for m, us in small.items()]}}  # fmt: skip
    c = Curves.from_descriptor(raw)
    t = lambda m, k, n: c.gemm_us(m, k, n, flops=2 * m * k * n, nbytes=2 * k * n, dtype="bfloat16", path="gemv")  # noqa: E731
    assert t(1, 4096, 4096) == pytest.approx(12.0)
    assert t(1, 512, 512) == pytest.approx(3.0)
    per = (12.0 - 3.0) / (4096**2 - 512**2)
    assert t(1, 1024, 2048) == pytest.approx(3.0 + per * (1024 * 2048 - 512**2))
    assert t(8, 1024, 2048) > t(1, 1024, 2048)
    del raw["calibration"]["gemm_crossover"]["points_small"]  # one size only: proportional to K*N, as before
    c = Curves.from_descriptor(raw)
    assert t(1, 1024, 2048) == pytest.approx(max(12.0 * 1024 * 2048 / 4096**2, 2 * 1024 * 2048 / 4000e3))


def test_rows_in_the_tensor_core_tier_are_priced_from_its_own_calibrated_timings(gpu):
    """Above tuning.gemv_max_tokens the few-rows groups run their tensor-core tier: a decode step at those rows is
    priced from calibration's gemv_dot timings (the CUDA-core kernel's grow with the rows), and from the CUDA-core
    ones where the tier was not timed; at one row the CUDA-core timings price it either way."""
    raw = synthetic("nvidia-h200", bandwidth=4000.0)
    raw["tuning"] = {**raw.get("tuning", {}), "gemv_max_tokens": 1, "gemv_dot_max_tokens": 16}
    # large times: the tiny decoder's weights are a small part of K = N = 4096, and the timings scale with K*N
    pts = [{"m": m, "triton_us": 5e7, "vendor_us": 2e7, "gemv_us": 1e7 * m, "gemv_dot_us": 5e6} for m in (1, 8, 16)]
    raw["calibration"] = {"gemm_crossover": {"k": 4096, "points": pts}}
    c = Curves.from_descriptor(raw)
    t = lambda path: c.gemm_us(8, 4096, 4096, flops=0, nbytes=0, dtype="bfloat16", path=path)  # noqa: E731
    assert t("gemv_dot") == pytest.approx(5e6) and t("gemv") == pytest.approx(8e7)
    no_dot = copy.deepcopy(raw)
    for q in no_dot["calibration"]["gemm_crossover"]["points"]:
        del q["gemv_dot_us"]
    assert Curves.from_descriptor(no_dot).gemm_us(8, 4096, 4096, flops=0, nbytes=0, dtype="bfloat16",
                                                  path="gemv_dot") == pytest.approx(8e7)
    gemm_us = lambda d, b: sum(g.us for g in predict(gpu.graph, gpu.plan, d, "decode", b, 32).groups  # noqa: E731
                               if g.family == "gemm")
    assert gemm_us(raw, 8) < gemm_us(no_dot, 8)
    assert gemm_us(raw, 1) == pytest.approx(gemm_us(no_dot, 1))


def test_a_gemms_floor_is_its_weight_read_at_the_sweeps_read_rate_past_the_caches():
    """A GEMM's floor is its weight read at the sweep's read rate at its largest working set (a sum: only
    reads), not the copy rate (reads + writes) and not a cache's read rate at a small working set."""
    raw = synthetic("nvidia-h200", bandwidth=1000.0)
    raw["throughput_tflops"] = {k: 1e9 for k in raw["throughput_tflops"]}  # memory-bound: the floor decides
    raw["calibration"] = {"bandwidth_sweep": [{"bytes": 1 << 20, "read_gbps": 20000.0, "copy_gbps": 9000.0},  # a cache
                                              {"bytes": 1 << 30, "read_gbps": 8000.0, "copy_gbps": 1000.0}]}
    c = Curves.from_descriptor(raw)
    assert c.gemm_us(1, 8192, 8192, flops=2 * 8192**2, nbytes=2 * 8192**2, dtype="bfloat16",
                     path="vendor") == pytest.approx(2 * 8192 * 8192 / 8000e3)


def _program_launches(result, batch: int, tmp) -> int:
    """Kernels the generated host program launches for one decode step of ``batch`` sequences, counted
    by running it (Triton interpreter): every Triton launch through its kernel namespace, every vendor
    GEMM as the aten matmul it dispatches."""
    return sum(_program_counts(result, [1] * batch, [16] * batch, tmp))


def _program_counts(result, lens: list[int], context: list[int], tmp) -> tuple[int, int]:
    """(Triton launches, vendor GEMMs) of one step of sequences with ``lens`` new tokens over ``context``
    cached ones, counted by running the generated program under the Triton interpreter."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from portlayer.backends.generate import generate
    from portlayer.backends.triton_program import load_program
    from portlayer.backends.tuning_runner import _step_inputs
    from portlayer.codegen.program import write_program

    write_program(generate(result.graph, result.plan, result.descriptor), tmp)
    prog = load_program(tmp, result.graph.weights, "cpu", result.plan, use_graphs=False)
    count, vendor = [0], [0]

    class Counted:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*a, **kw):
                count[0] += 1
                return launch(*a, **kw)

            return run

    for name, kernel in list(vars(prog.K).items()):
        setattr(prog.K, name, Counted(kernel))

    class VendorGemms(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm"):
                vendor[0] += 1
            return func(*args, **(kwargs or {}))

    feeds, md, caches = _step_inputs(result.graph, lens, context, 16, torch.float32, torch.device("cpu"))
    with torch.inference_mode(), VendorGemms():
        prog.run(feeds, md, caches)
    return count[0], vendor[0]


def test_predicted_launches_are_the_generated_programs_at_one_and_many_rows(tmp_path):
    """At one row the few-rows kernel reads Q|K|V (and gate|up) in one launch with the norm prologue and the
    SiLU*up epilogue inside; at 2 rows its tensor-core tier (tuning.gemv_dot_max_tokens) makes the same launches;
    past the tier each linear is its own vendor GEMM and the norm and epilogue their own kernels
    (codegen/kernels/gemm_group.py). The model's launch count equals the program's, counted by running it."""
    import json

    raw = copy.deepcopy(dict(load_descriptor("nvidia-h200").raw))
    tier = raw["tuning"]["gemv_dot_max_tokens"] = 16  # the shipped H200 has the tier off (measured): turned on here
    raw["name"] = "nvidia-h200-tier"
    assert raw["tuning"]["gemv_max_tokens"] == 1 < 2 <= tier and raw["tuning"]["triton_gemm_max_tokens"] == 0
    (tmp_path / "tier.json").write_text(json.dumps(raw))
    desc = load_descriptor(tmp_path / "tier.json")
    fp32 = run_pipeline(tiny_decoder(tied=False), desc, overrides={"compute_dtype": "float32"})  # interpretable
    for batch in (1, 2, tier + 1):  # the CUDA-core rule (1), the tensor-core tier, past it
        predicted = predict(fp32.graph, fp32.plan, raw, "decode", batch=batch, context=16).launches
        assert predicted == _program_launches(fp32, batch, tmp_path / f"b{batch}"), batch


def test_eager_generated_steps_pay_a_fixed_host_cost_plus_one_per_kernel(tmp_path):
    """Calibration times an eager one-kernel and two-kernel generated program: the step's host time is the
    one-kernel step plus the difference for every further kernel (not the whole step per kernel), and each
    vendor GEMM the host dispatches as a torch op costs the calibrated eager torch-op launch; the launches and
    vendor GEMMs of an 8-token prefill are counted by running the generated program."""
    fp32 = run_pipeline(tiny_decoder(tied=False), "nvidia-h200",
                        overrides={"compute_dtype": "float32", "step_graph_tokens": []})  # no step graphs: eager
    kernels, vendor = _program_counts(fp32, [8], [0], tmp_path / "p8")
    raw = synthetic("nvidia-h200", bandwidth=1e12, tflops=1e12)
    raw["calibration"] = {"launch_us": {"eager_us": 5.0, "triton_us": 60.0, "triton_kernel_us": 10.0}}
    p = predict(fp32.graph, fp32.plan, raw, "prefill", tokens=8)
    assert not p.graphs and p.launches == kernels + vendor and vendor > 0
    assert p.host_ms == pytest.approx((50.0 + 10.0 * kernels + 5.0 * vendor) / 1e3, rel=1e-6)
    del raw["calibration"]["launch_us"]["triton_kernel_us"]
    p = predict(fp32.graph, fp32.plan, raw, "prefill", tokens=8)
    assert p.host_ms == pytest.approx((60.0 * kernels + 5.0 * vendor) / 1e3, rel=1e-6)


def test_calibrated_generated_attention_sets_the_decode_attention_time(gpu):
    """With calibration.attention_generated (the generated split-K kernel and its reduce, timed as a step runs
    them) a Triton target's decode attention follows its fit: more context adds the extra KV bytes at the fit's
    rate, more sequences add per_seq_us each; prefill attention is not taken from the decode fit."""
    raw = synthetic("nvidia-h200", bandwidth=4000.0)
    fit = {"fixed_us": 5.0, "per_seq_us": 0.5, "gbps": 1000.0}
    raw["calibration"] = {"attention_generated": {**fit, "points": []}}

    def attn(p):
        return sum(g.us for g in p.groups if g.bound == "attention")

    layers = sum(1 for k in gpu.graph.meta["kernels"] if k.get("family") == "attention")
    a = predict(gpu.graph, gpu.plan, raw, "decode", batch=4, context=64)
    b = predict(gpu.graph, gpu.plan, raw, "decode", batch=4, context=128)
    c = predict(gpu.graph, gpu.plan, raw, "decode", batch=8, context=64)
    import torch

    item = getattr(torch, gpu.plan.kv_cache_dtype).itemsize  # the Plan's cache dtype
    kv_per_token = 2 * KV_HEADS * HEAD_DIM * item * 4  # K and V in the cache's dtype, 4 sequences
    assert attn(b) - attn(a) == pytest.approx(layers * 64 * kv_per_token / (fit["gbps"] * 1e3), rel=1e-6)
    extra_q_out = attn(c) - attn(a) - layers * 4 * fit["per_seq_us"] - layers * 65 * kv_per_token / (fit["gbps"] * 1e3)
    assert 0 <= extra_q_out < 0.05 * attn(c)  # what remains: the q and output bytes of 4 more tokens
    pre = predict(gpu.graph, gpu.plan, raw, "prefill", tokens=64)
    del raw["calibration"]
    assert attn(pre) == pytest.approx(attn(predict(gpu.graph, gpu.plan, raw, "prefill", tokens=64)), rel=1e-9)


def test_replayed_decode_step_adds_the_calibrated_host_cost_interpolated_in_batch(gpu, gpu_eager):
    """calibration.graph_step (a replayed decode step's host cost when each step is waited for, at two batches):
    a graph-replayed decode step is its kernels plus that cost at the step's batch (linear between the points)
    plus copying the outputs out of the static buffers; eager steps and uncalibrated descriptors are unchanged."""
    raw = synthetic("nvidia-h200", bandwidth=1000.0)
    base = {b: predict(gpu.graph, gpu.plan, raw, "decode", batch=b, context=32) for b in (1, 8, 64)}
    raw["calibration"] = {"graph_step": {"context": 16, "points": [{"batch": 1, "host_us": 40.0},
                                                                    {"batch": 64, "host_us": 103.0}]}}
    out_row_bytes = sum(t.nbytes({"num_tokens": 1, "num_seqs": 1, gpu.graph.meta.get("token_symbol", "num_tokens"): 1})
                        for o, t in gpu.graph.value_types().items() if o in gpu.graph.outputs)
    for b, host in ((1, 40.0), (8, 47.0), (64, 103.0)):
        p = predict(gpu.graph, gpu.plan, raw, "decode", batch=b, context=32)
        assert p.graphs
        copy_us = 2 * b * out_row_bytes / (1000.0 * 1e3)
        assert p.ms - base[b].ms == pytest.approx((host + copy_us) / 1e3, rel=1e-6)
    pre = [predict(gpu_eager.graph, gpu_eager.plan, r, "prefill", tokens=16).ms for r in (raw, synthetic("nvidia-h200", 1000.0))]
    assert pre[0] == pytest.approx(pre[1], rel=1e-9)


def test_the_waited_replay_host_cost_grows_with_the_models_attention_layers_from_two_calibrated_depths(gpu):
    """calibration.graph_step at two program depths (1 and 16 attention layers, batch 1 and 64): a model of L
    attention layers pays the 1-layer cost plus the per-layer slope times L - 1 (interpolated in batch first);
    a slope that comes out negative (noise) adds nothing; without a depth the single depth's cost is used."""
    raw = synthetic("nvidia-h200", bandwidth=1000.0)
    layers = sum(1 for n in gpu.graph.nodes if n.op == "attention")
    ins = [v.name for v in gpu.graph.inputs]

    def extra(points: list[tuple[int, int, float]], batch: int) -> float:
        r = copy.deepcopy(raw)
        r["calibration"] = {"graph_step": {"context": 16, "inputs": ins, "points": [
            {"batch": b, "layers": n, "host_us": us} for b, n, us in points]}}
        return (predict(gpu.graph, gpu.plan, r, "decode", batch=batch, context=32).ms
                - predict(gpu.graph, gpu.plan, raw, "decode", batch=batch, context=32).ms) * 1e3

    def copy_us(batch: int) -> float:
        row = sum(t.nbytes({"num_tokens": 1, "num_seqs": 1, gpu.graph.meta.get("token_symbol", "num_tokens"): 1})
                  for o, t in gpu.graph.value_types().items() if o in gpu.graph.outputs)
        return 2 * batch * row / (1000.0 * 1e3)

    deep = [(1, 1, 40.0), (64, 1, 100.0), (1, 16, 70.0), (64, 16, 160.0)]  # slope 2 us/layer at b1, 4 at b64
    assert extra(deep, 1) == pytest.approx(40.0 + 2.0 * (layers - 1) + copy_us(1), rel=1e-6)
    assert extra(deep, 64) == pytest.approx(100.0 + 4.0 * (layers - 1) + copy_us(64), rel=1e-6)
    noisy = [(1, 1, 40.0), (1, 16, 31.0)]
    assert extra(noisy, 1) == pytest.approx(40.0 + copy_us(1), rel=1e-6)
    assert extra([(1, 1, 40.0)], 1) == pytest.approx(40.0 + copy_us(1), rel=1e-6)
    # a 28-layer model (the Qwen3-0.6B shape) from the same points, and batch 16 between 1 and 64
    raw["calibration"] = {"graph_step": {"points": [{"batch": b, "layers": n, "host_us": us} for b, n, us in deep]}}
    curves = Curves.from_descriptor(raw)
    assert curves.graph_step_us(1, 28) == pytest.approx(40.0 + 2.0 * 27)
    assert curves.graph_step_us(16, 28) == pytest.approx((40.0 + 60.0 * 15 / 63) + (2.0 + 2.0 * 15 / 63) * 27)
    raw["calibration"]["graph_step"]["points"] = [{"batch": 1, "host_us": 40.0}]  # a file from before depths
    assert Curves.from_descriptor(raw).graph_step_us(1, 28) == pytest.approx(40.0)


def test_a_deeper_model_pays_the_per_layer_slope_for_each_of_its_kv_cache_layers():
    """The model's depth is its KV-cache layers, counted from the graph (here calibrate's own decode-step program
    at 1 and 3 attention layers, each with a cache): the 3-layer graph pays two slopes more than the 1-layer one."""
    import torch

    from portlayer.backends.calibration_runner import one_decode_step

    raw = synthetic("nvidia-h200", bandwidth=1000.0)
    cal = copy.deepcopy(raw)
    cal["calibration"] = {"graph_step": {"context": 16, "inputs": ["input_ids", "positions", "logits_indices"],
                                         "points": [{"batch": 1, "layers": 1, "host_us": 40.0},
                                                    {"batch": 1, "layers": 16, "host_us": 70.0}]}}  # 2 us / layer
    extra = {}
    for layers in (1, 3):
        res = run_pipeline(one_decode_step((4, 2, 16), torch.float32, vocab=32, layers=layers), "nvidia-h200")
        assert sum(1 for n in res.graph.nodes if n.op == "attention") == layers
        extra[layers] = (predict(res.graph, res.plan, cal, "decode", batch=1, context=32).ms
                         - predict(res.graph, res.plan, raw, "decode", batch=1, context=32).ms) * 1e3
    assert extra[3] - extra[1] == pytest.approx(2 * 2.0, abs=1e-3)  # the output copies are the same size


def test_each_input_the_calibrated_decode_step_lacked_costs_one_copy_call(gpu):
    """The calibrated decode-step program copies its inputs into the graph's static buffers; a graph with
    more inputs than it had pays one host copy call (the eager launch cost) per extra input, fewer saves one."""
    raw = synthetic("nvidia-h200", bandwidth=1000.0, launch=3.0)
    n = len(gpu.graph.inputs)

    def with_inputs(k: int) -> float:
        r = copy.deepcopy(raw)
        r["calibration"] = {"graph_step": {"context": 16, "inputs": [f"in{i}" for i in range(k)],
                                           "points": [{"batch": 1, "layers": 1, "host_us": 50.0}]}}
        return predict(gpu.graph, gpu.plan, r, "decode", batch=1, context=32).ms * 1e3

    assert with_inputs(n) - with_inputs(n + 2) == pytest.approx(2 * 3.0, rel=1e-6)
    assert with_inputs(n - 1) - with_inputs(n) == pytest.approx(3.0, rel=1e-6)


def test_each_graph_node_adds_its_calibrated_submission_cost_to_a_waited_replay(gpu, gpu_eager):
    """calibration.launch_us.graph_node_host_us: a replayed decode step pays it once per launch of the step
    (launches counted by the model from the graph's kernel groups); eager prefill does not."""
    raw = synthetic("nvidia-h200", bandwidth=1000.0)
    before = predict(gpu.graph, gpu.plan, raw, "decode", batch=4, context=32)
    pre = predict(gpu_eager.graph, gpu_eager.plan, raw, "prefill", tokens=16).ms
    raw["calibration"] = {"launch_us": {"eager_us": 1e-9, "graph_us": None, "graph_node_host_us": 0.75}}
    after = predict(gpu.graph, gpu.plan, raw, "decode", batch=4, context=32)
    assert after.launches == before.launches > 0
    assert after.ms - before.ms == pytest.approx(after.launches * 0.75 / 1e3, rel=1e-6)
    assert predict(gpu_eager.graph, gpu_eager.plan, raw, "prefill", tokens=16).ms == pytest.approx(pre, rel=1e-9)
