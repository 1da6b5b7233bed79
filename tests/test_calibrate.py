"""Calibration measures this device and writes a descriptor that says so."""

from __future__ import annotations

import json

import pytest
import torch

from portlayer.capabilities.calibrate import (
    CPU_SIZES,
    Sizes,
    calibrate,
    measure_copy_bandwidth,
    measure_matmul,
)
from portlayer.capabilities.descriptor import Descriptor, load_descriptor
from portlayer.capabilities.policy import ModelRequirements, negotiate

TINY = Sizes(copy_bytes=16 * 2**20, matmul_n=256, iters=3, warmup=1, launches=200, max_seconds_per_dtype=0.3)


@pytest.fixture(scope="module")
def cpu_calibrated():
    return calibrate("cpu", sizes=TINY)


def test_cpu_calibration_validates_and_says_calibrated(cpu_calibrated):
    d = cpu_calibrated
    assert d["name"] == "cpu-x86_64-calibrated"
    assert d["memory"]["bandwidth_gbps"] > 0.1 and d["throughput_tflops"]["fp32"] > 1e-4
    assert d["launch_overhead_us"] > 0
    for key in ("memory.bandwidth_gbps", "throughput_tflops.fp32", "launch_overhead_us", "memory.capacity_gb"):
        assert d["sources"][key].startswith("calibrated on ")
    assert d["sources"]["memory.alignment_bytes"] == load_descriptor("cpu-x86_64").source("memory.alignment_bytes")
    assert d["calibration"]["base_descriptor"] == "cpu-x86_64"
    desc = Descriptor.from_dict(d, origin="calibration")
    assert desc.compute_units.count >= 1


def test_emulated_dtypes_are_listed_absent(cpu_calibrated):
    tp = cpu_calibrated["throughput_tflops"]
    slow = cpu_calibrated["calibration"]["emulated_dtypes_tflops"]
    for k, v in slow.items():
        assert k not in tp and v < tp["fp32"] / 8


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
    assert 0.1 < measure_copy_bandwidth(dev, TINY) < 2000
    assert measure_matmul(dev, "tf32", TINY) is None  # tf32 is a GPU mode
    assert measure_matmul(dev, "fp8", TINY) is None


def test_cpu_sizes_stay_small():
    assert CPU_SIZES.copy_bytes <= 256 * 2**20 and CPU_SIZES.matmul_n <= 1024


def test_calibrate_cli_writes_a_descriptor(tmp_path, monkeypatch, capsys):
    import portlayer.capabilities.calibrate as cal
    from portlayer.cli_capabilities import main

    monkeypatch.setattr(cal, "CPU_SIZES", TINY)
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--device", "cpu", "-o", str(out)]) == 0
    assert "GB/s" in capsys.readouterr().err
    assert load_descriptor(out).name == "cpu-x86_64-calibrated"
