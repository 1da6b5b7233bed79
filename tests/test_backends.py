"""The adapter contract, the built-in CPU/CUDA adapters and out-of-tree discovery."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from portlayer.backends import BackendError, available_backends, get_backend, registry
from portlayer.backends.cpu import CPUAdapter
from portlayer.backends.cuda import CUDAAdapter
from portlayer.capabilities.descriptor import Descriptor, load_descriptor

FIXTURE = Path(__file__).parent / "fixtures" / "portlayer_fake_backend"
HAS_CUDA = torch.cuda.is_available() and torch.version.hip is None
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")


def _descriptor_with_alignment(align: int) -> Descriptor:
    raw = load_descriptor("cpu-x86_64").raw
    raw["memory"]["alignment_bytes"] = align
    return Descriptor.from_dict(raw, origin="test")


def test_builtins_registered():
    names = available_backends()
    assert {"cpu", "cuda"} <= set(names)
    assert registry.backend_class("cpu") is CPUAdapter and CPUAdapter.codegen_family == "torch"
    assert CUDAAdapter.codegen_family == "triton" and CUDAAdapter.device_type == "cuda"


def test_cpu_adapter_contract():
    b = get_backend("cpu")
    assert isinstance(b, CPUAdapter) and b.torch_device == "cpu" and b.descriptor.name == "cpu-x86_64"
    assert CPUAdapter.is_available()
    mem = b.query_memory_capacity()
    assert mem.total_bytes >= mem.free_bytes > 0
    buf = b.allocate(1000)
    assert buf.dtype == torch.uint8 and buf.numel() == 1024 and buf.data_ptr() % 64 == 0
    pinned = b.allocate_pinned(10)
    assert pinned.data_ptr() % 64 == 0
    b.synchronize()
    assert b.memory_fence_scope() == "none" and b.supports_graph_capture() is False


@pytest.mark.parametrize("align", [64, 512, 4096, 2 * 2**20])
def test_allocate_honours_the_descriptor_alignment(align):
    b = get_backend(_descriptor_with_alignment(align))
    for size in (1, 777, align + 1):
        buf = b.allocate(size)
        assert buf.data_ptr() % align == 0 and buf.numel() % align == 0 and buf.numel() >= size
        buf.view(torch.float32)  # aligned views reinterpret cleanly
    assert b.allocate(100, alignment=16).data_ptr() % 16 == 0


def test_allocate_rejects_bad_requests():
    b = get_backend("cpu")
    with pytest.raises(BackendError, match="power of two"):
        b.allocate(10, alignment=48)
    with pytest.raises(BackendError, match="negative"):
        b.allocate(-1)


def test_copy_checks_sizes_and_reinterprets_bytes():
    b = get_backend("cpu")
    src = torch.arange(16, dtype=torch.float32)
    dst = b.allocate(64).view(torch.float32)
    b.copy(dst, src)
    assert torch.equal(dst, src)
    raw = b.allocate(64)
    b.copy(raw, src)  # float32 -> bytes
    assert torch.equal(raw.view(torch.float32), src)
    with pytest.raises(BackendError, match="copy of 64 bytes"):
        b.copy(torch.empty(3), src)


def test_get_backend_by_descriptor_picks_the_device_type():
    h200 = get_backend("nvidia-h200")
    assert isinstance(h200, CUDAAdapter) and h200.torch_device == "cuda:0"
    assert h200.memory_fence_scope() == "warp"
    ascend = get_backend("ascend-910b")  # registered since backends/ascend.py (runs only on the CPU emulator here)
    assert type(ascend).__name__ == "AscendAdapter" and ascend.codegen_family == "cann"
    with pytest.raises(KeyError, match="neither a backend"):
        get_backend("quantum-9000")
    with pytest.raises(BackendError, match="device_type 'cpu'"):
        CUDAAdapter(load_descriptor("cpu-x86_64"))


@pytest.mark.skipif(HAS_CUDA, reason="checks the error on a machine without CUDA")
def test_cuda_adapter_without_gpu_says_why():
    with pytest.raises(BackendError, match="not usable here"):
        get_backend("nvidia-h200").allocate(16)
    assert not CUDAAdapter.is_available()


@gpu
def test_cuda_adapter_on_a_real_gpu():
    b = get_backend("cuda")
    assert b.descriptor.device_type == "cuda"
    mem = b.query_memory_capacity()
    assert mem.total_bytes > 1e9 and 0 < mem.free_bytes <= mem.total_bytes
    for align in (256, 512, 4096):
        buf = b.allocate(3000, alignment=align)
        assert buf.is_cuda and buf.data_ptr() % align == 0 and buf.numel() == -(-3000 // align) * align
    host = b.allocate_pinned(4096)
    assert host.is_pinned() and host.device.type == "cpu"
    src = torch.randn(1024)
    dev = b.allocate(4096).view(torch.float32)
    b.copy(dev, src, non_blocking=False)  # host -> device
    dev2 = b.allocate(4096).view(torch.float32)
    b.copy(dev2, dev)  # device -> device
    back = host.view(torch.float32)
    b.copy(back, dev2, non_blocking=True)  # device -> pinned host
    b.synchronize()
    assert torch.equal(back, src)
    assert b.memory_fence_scope() == "warp" and b.supports_graph_capture()
    if "H200" in torch.cuda.get_device_name(0):
        assert b.descriptor.name == "nvidia-h200"


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """pip-install the fixture adapter package into a temp dir (the venv stays clean)."""
    from portlayer.capabilities import plugins, probe

    registry.load_backends()  # built-ins first, while the plugin is not importable
    target = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(FIXTURE)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    monkeypatch.syspath_prepend(str(target))
    importlib.invalidate_caches()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_ORIGINS", dict(registry._ORIGINS))
    monkeypatch.setattr(plugins, "_DECLARED", dict(plugins._DECLARED))
    yield target
    sys.modules.pop("portlayer_fake_backend", None)
    plugins._entry_points.cache_clear()  # later tests must not see the uninstalled plugin's devices
    probe._probe_all.cache_clear()


def test_out_of_tree_adapter_through_entry_points(installed_plugin):
    assert "fakeaccel" not in registry._REGISTRY
    with pytest.warns(RuntimeWarning, match="brokenaccel.*failed to load"):
        names = available_backends(refresh=True)
    assert "fakeaccel" in names and "brokenaccel" not in names
    assert "portlayer-fake-backend" in registry.backend_origin("fakeaccel")
    b = get_backend("fakeaccel")
    assert type(b).__name__ == "FakeAccelAdapter" and b.name == "fakeaccel"
    assert b.descriptor.name == "fakeaccel-1" and b.descriptor.device_type == "fakeaccel"  # from its own probe()
    buf = b.allocate(100)
    assert buf.data_ptr() % 128 == 0 and type(b).allocations == 1
    assert b.query_memory_capacity().total_bytes == 1 << 30
