"""Descriptors are data: hostile or degenerate JSON gets a clear DescriptorError, tuned
constants live in descriptors with sources, and calibration never writes a zero."""

from __future__ import annotations

import json
import math

import pytest

from portlayer.capabilities import calibrate as cal
from portlayer.capabilities.descriptor import Descriptor, DescriptorError, load_descriptor


def test_nan_and_infinity_throughput_are_refused_before_the_policy(tmp_path, capsys):
    from portlayer.cli import main

    for bad in ("NaN", "Infinity", "-Infinity"):
        text = json.dumps(load_descriptor("nvidia-h200").raw).replace('"bf16": 989.4', f'"bf16": {bad}')
        f = tmp_path / "bad.json"
        f.write_text(text)
        assert json.loads(text)["throughput_tflops"]["bf16"] != 989.4  # the reader really accepts it
        with pytest.raises(DescriptorError) as e:
            load_descriptor(f)
        assert (e.value.path, e.value.rule) == ("$.throughput_tflops.bf16", "finite"), str(e.value)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                               "vocab_size": 100, "intermediate_size": 128}))
    capsys.readouterr()
    assert main(["explain", str(cfg), "--target", str(f)]) == 2  # a user error: one message, exit 2
    err = capsys.readouterr().err
    assert "$.throughput_tflops.bf16: finite" in err and "Traceback" not in err


def test_deep_json_is_a_clear_error_not_recursion(tmp_path):
    f = tmp_path / "deep.json"
    f.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DescriptorError) as e:
        load_descriptor(f)
    assert e.value.rule == "max_depth" and str(f) in str(e.value)
    raw = load_descriptor("cpu-x86_64").raw
    node = raw["sources"]
    for _ in range(50_000):  # built in memory: reaches validation without a JSON reader
        node["x"] = {}
        node = node["x"]
    with pytest.raises(DescriptorError) as e:
        Descriptor.from_dict(raw, origin="deep-dict")
    assert e.value.rule == "max_depth" and e.value.path.startswith("$.sources.x.x")


def test_gemm_crossover_is_descriptor_data_with_a_source(tmp_path):
    from portlayer.codegen.gemm_rule import triton_gemm_max_tokens

    h200 = load_descriptor("nvidia-h200")
    assert h200.tuning["triton_gemm_max_tokens"] == triton_gemm_max_tokens(h200) == 0
    assert "bench_kernels" in h200.source("tuning.triton_gemm_max_tokens")
    assert triton_gemm_max_tokens(load_descriptor("amd-mi300x")) == 0  # nobody measured: the vendor GEMM
    raw = h200.raw
    raw["tuning"]["triton_gemm_max_tokens"] = 64
    assert triton_gemm_max_tokens(Descriptor.from_dict(raw)) == 64
    del raw["sources"]["tuning.triton_gemm_max_tokens"]
    with pytest.raises(DescriptorError, match="has_source"):
        Descriptor.from_dict(raw)
    raw = h200.raw
    raw["tuning"]["triton_gemm_max_tokens"] = -1
    with pytest.raises(DescriptorError, match="minimum"):
        Descriptor.from_dict(raw)


def test_aot_targets_come_from_the_descriptors(tmp_path):
    from portlayer.codegen.aot import parse_target, targets

    t = targets()
    want = {}
    for name in ("nvidia-a100-80gb", "nvidia-h200", "nvidia-rtx4060-laptop", "amd-mi300x", "amd-rx7900xtx"):
        d = load_descriptor(name)
        alias = d.arch.replace("_", "")
        want[alias] = ("cuda", int(d.arch[3:]), d.warp_size) if d.device_type == "cuda" else ("hip", d.arch, d.warp_size)
    assert t == want  # PyPI Triton's own targets; XPU goes through triton-xpu, ascend and cpu compile no Triton
    assert parse_target("nvidia-h200") == parse_target("sm90") == ("cuda", 90, 32)
    assert parse_target("amd-mi300x") == ("hip", "gfx942", 64)  # the wavefront width from the descriptor
    raw = load_descriptor("amd-mi300x").raw
    raw.update(name="mi-new", arch="gfx950")
    f = tmp_path / "mi-new.json"
    f.write_text(json.dumps(raw))
    assert parse_target(str(f)) == ("hip", "gfx950", 64)  # a new descriptor is a new target
    assert parse_target("intel-arc-a770")[0] == "xpu"  # SPIR-V through triton-xpu (codegen/xpu_toolchain.py)
    with pytest.raises(SystemExit, match="not a CUDA or ROCm Triton target"):
        parse_target("ascend-910b")


def test_calibration_never_rounds_a_slow_dtype_to_zero():
    measured = {"fp64": 0.00003, "fp32": 0.000412345, "bf16": 0.000045, "fp16": 0.00049, "int8": 0.0012}
    results = {"sweep": [{"bytes": 2**20, "read_gbps": 0.05, "copy_gbps": 0.04321}], "matmul": measured,
               "gemm_curves": {}, "attention": {"points": []}, "launch": {"eager_us": 0.0031, "graph_us": None}}
    raw = cal.load_descriptor("cpu-x86_64").raw
    out = cal.finish(raw, "cpu-x86_64", cal.torch.device("cpu"), cal.CPU_SIZES, results)
    Descriptor.from_dict(out)  # validates: no 0.0 anywhere
    tp = out["throughput_tflops"]
    assert set(tp) == {"fp32", "fp16", "int8"}  # fp64 and bf16 are below fp32/8: absent, not 0
    for k, v in tp.items():
        assert math.isclose(v, measured[k], rel_tol=1e-3)
    slow = out["calibration"]["emulated_dtypes_tflops"]
    assert set(slow) == {"fp64", "bf16"} and all(math.isclose(slow[k], measured[k], rel_tol=1e-3) for k in slow)
    assert math.isclose(out["memory"]["bandwidth_gbps"], 0.04321, rel_tol=1e-3)
    assert math.isclose(out["launch_overhead_us"], 0.0031, rel_tol=1e-3)
