"""Device probing: what is here, what it matched, and why everything else was skipped."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from portlayer.capabilities import probe
from portlayer.capabilities.probe import DetectedDevice, default_target, match_descriptor, probe_devices


@pytest.fixture(autouse=True)
def fresh_probe():
    probe._probe_all.cache_clear()
    yield
    probe._probe_all.cache_clear()


def test_cpu_always_found_and_matched():
    cpus = [d for d in probe_devices() if d.device_type == "cpu"]
    assert len(cpus) == 1 and cpus[0].usable and cpus[0].torch_device == "cpu"
    assert cpus[0].descriptor == "cpu-x86_64"
    assert cpus[0].memory_bytes and cpus[0].memory_bytes > 2**30


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only torch build")
def test_cpu_only_build_explains_missing_gpu():
    cuda = [d for d in probe_devices() if d.device_type == "cuda"]
    assert cuda and cuda[0].status == "skipped"
    assert "CPU-only build" in cuda[0].reason and "torch.version.cuda is None" in cuda[0].reason
    assert default_target().name == "cpu-x86_64"


@pytest.mark.skipif(Path("/dev/dri/renderD128").exists(), reason="this host has an Intel render node")
def test_xpu_missing_render_node_message():
    xpu = [d for d in probe_devices() if d.device_type == "xpu"][0]
    assert xpu.status == "skipped"
    assert "/dev/dri/renderD128 missing" in xpu.reason and "--device /dev/dri" in xpu.reason


def test_probe_runs_once_per_process_and_refresh(monkeypatch):
    calls = []
    monkeypatch.setitem(probe.PROBES, "xpu", lambda: calls.append(1) or [])
    probe_devices()
    probe_devices()
    assert len(calls) == 1
    probe_devices(refresh=True)
    assert len(calls) == 2


def test_a_crashing_probe_is_reported_not_raised(monkeypatch):
    def boom():
        raise RuntimeError("driver exploded")

    monkeypatch.setitem(probe.PROBES, "cuda", boom)
    cuda = [d for d in probe_devices() if d.device_type == "cuda"]
    assert cuda[0].status == "skipped" and "driver exploded" in cuda[0].reason


def test_npu_not_imported_without_cann(monkeypatch, tmp_path):
    # a torch_npu that would break the process if imported
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("raise SystemExit('imported torch_npu')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    if Path("/usr/local/Ascend").exists():
        pytest.skip("this host has CANN installed")
    (npu,) = probe._probe_npu()
    assert npu.status == "skipped" and "CANN is not" in npu.reason and "not importing torch_npu" in npu.reason


def test_npu_import_failure_is_reported(monkeypatch, tmp_path):
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(
        "raise OSError('libhccl.so: cannot open shared object file: No such file or directory')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    (npu,) = probe._probe_npu()
    assert npu.status == "skipped" and "libhccl.so" in npu.reason and "OSError" in npu.reason


def test_npu_absent_reason():
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu installed here")
    (npu,) = probe._probe_npu()
    assert "torch_npu is not installed" in npu.reason


def test_importing_portlayer_never_imports_torch_npu():
    code = textwrap.dedent(
        """
        import sys, portlayer.capabilities.probe as p, portlayer.backends
        p.probe_devices()
        import torch
        assert 'torch_npu' not in sys.modules
        print('ok')
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize(
    "kind,name,arch,expect,status",
    [
        ("cuda", "NVIDIA H200", "sm_90", "nvidia-h200", "matched"),
        ("cuda", "NVIDIA H100 80GB HBM3", "sm_90", "nvidia-h100-sxm", "matched"),
        ("cuda", "NVIDIA A100-SXM4-80GB", "sm_80", "nvidia-a100-80gb", "matched"),
        ("cuda", "NVIDIA GeForce RTX 4060 Laptop GPU", "sm_89", "nvidia-rtx4060-laptop", "matched"),
        ("cuda", "NVIDIA H800", "sm_90", "nvidia-h100-sxm", "matched-by-arch"),
        ("rocm", "AMD Instinct MI300X", "gfx942", "amd-mi300x", "matched"),
        ("rocm", "Radeon RX 7900 XTX", "gfx1100", "amd-rx7900xtx", "matched"),
        ("xpu", "Intel(R) Arc(TM) A770 Graphics", "xe-hpg", "intel-arc-a770", "matched"),
        ("xpu", "Intel(R) UHD Graphics 770", "xe-lp", "intel-uhd-770", "matched"),
        ("ascend", "Ascend910B3", "Ascend910B", "ascend-910b", "matched"),
        ("rocm", "Radeon RX 9070", "gfx1201", None, "unmatched"),
    ],
)
def test_match_descriptor(kind, name, arch, expect, status):
    desc, got_status, reason = match_descriptor(kind, name, arch)
    assert (desc, got_status) == (expect, status)
    assert reason
    if status != "matched":
        assert "calibrate" in reason


def test_default_target_prefers_the_fastest_usable_accelerator():
    cpu = DetectedDevice("cpu", 0, "x", "x86_64", "cpu", "cpu-x86_64", "matched", "")
    a100 = DetectedDevice("cuda", 0, "NVIDIA A100", "sm_80", "cuda:0", "nvidia-a100-80gb", "matched", "")
    h200 = DetectedDevice("cuda", 1, "NVIDIA H200", "sm_90", "cuda:1", "nvidia-h200", "matched", "")
    odd = DetectedDevice("rocm", 0, "?", "gfx1201", "cuda:2", None, "unmatched", "")
    assert default_target([cpu, a100, h200, odd]).name == "nvidia-h200"
    assert default_target([cpu, odd]).name == "cpu-x86_64"
    assert default_target([]).name == "cpu-x86_64"


def test_devices_cli(capsys):
    from portlayer.cli_capabilities import main

    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "cpu-x86_64" in out and "default target" in out
    if torch.version.cuda is None:
        assert "CPU-only build" in out and "falling back to the CPU" in out
    assert main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {d["device_type"] for d in data["devices"]} >= {"cpu", "cuda", "xpu", "ascend"}
    assert data["default_target"]
