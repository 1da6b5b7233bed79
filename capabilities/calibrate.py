"""Measure the present device and write a descriptor whose numbers say 'calibrated'.

Datasheet peaks are upper bounds a kernel never reaches; the policy plans better on
what the device really sustains. Fields a micro-benchmark cannot see (features,
alignment, DMA engines, fence scope) are kept from the shipped descriptor probe matched.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from portlayer.capabilities.descriptor import deep_merge, load_descriptor, validate

MATMUL_DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")
SLOW_FRACTION = 1 / 8  # a dtype slower than this share of fp32 is emulated: listed as absent
SIGNIFICANT = 4  # measurements keep 4 significant digits: a slow dtype on a loaded host is never rounded to 0


def _sig(x: float, digits: int = SIGNIFICANT) -> float:
    """``x`` to ``digits`` significant digits; positive stays positive (round(x, 3) made 0.0004 TFLOP/s 0.0)."""
    return float(f"{x:.{digits}g}")


@dataclass(frozen=True)
class Sizes:
    copy_bytes: int
    matmul_n: int
    iters: int
    warmup: int
    launches: int
    max_seconds_per_dtype: float


CPU_SIZES = Sizes(copy_bytes=128 * 2**20, matmul_n=1024, iters=5, warmup=1, launches=2000, max_seconds_per_dtype=1.5)
GPU_SIZES = Sizes(copy_bytes=2 * 2**30, matmul_n=8192, iters=30, warmup=5, launches=5000, max_seconds_per_dtype=10.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_iter(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int) -> float:
    """Seconds per call; CUDA events on a GPU (device time), perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def measure_copy_bandwidth(device: torch.device, sizes: Sizes) -> float:
    """GB/s of a device-to-device copy, counting bytes read plus bytes written (like STREAM copy)."""
    n = sizes.copy_bytes
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = time_per_iter(lambda: dst.copy_(src), device, sizes.iters, sizes.warmup)
    return 2 * n / t / 1e9


def _matmul_fn(dtype: str, n: int, device: torch.device) -> Callable[[], Any] | None:
    if dtype == "int8":
        if not hasattr(torch, "_int_mm"):
            return None
        a = torch.randint(-8, 8, (n, n), dtype=torch.int8, device=device)
        b = torch.randint(-8, 8, (n, n), dtype=torch.int8, device=device)
        return lambda: torch._int_mm(a, b)
    if dtype == "fp8":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            return None
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    tdt = {"fp64": torch.float64, "fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a = torch.randn(n, n, device=device, dtype=tdt)
    b = torch.randn(n, n, device=device, dtype=tdt)
    return lambda: torch.mm(a, b)


def measure_matmul(device: torch.device, dtype: str, sizes: Sizes) -> float | None:
    """Dense n^3 matmul TFLOP/s (TOP/s for int8); None when this torch/device cannot run it."""
    if dtype == "tf32" and device.type != "cuda":
        return None
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        n = sizes.matmul_n
        fn = _matmul_fn(dtype, n, device)
        if fn is None:
            return None
        t0 = time.perf_counter()
        fn()
        _sync(device)
        first = time.perf_counter() - t0
        iters = max(1, min(sizes.iters, int(sizes.max_seconds_per_dtype / max(first, 1e-6))))
        t = time_per_iter(fn, device, iters, min(sizes.warmup, iters))
        return 2 * n**3 / t / 1e12
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def measure_launch_latency(device: torch.device, sizes: Sizes) -> float:
    """Host microseconds per tiny op launch (what an eager decode step pays per kernel)."""
    x = torch.zeros(1, device=device)
    for _ in range(100):
        x.add_(1)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(sizes.launches):
        x.add_(1)
    t = time.perf_counter() - t0
    _sync(device)
    return t / sizes.launches * 1e6


def _device_facts(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        return {"name": p.name, "units": p.multi_processor_count, "memory_bytes": total}
    from portlayer.capabilities.probe import _cpu_model_name, _host_memory_bytes

    return {"name": _cpu_model_name() or platform.machine(), "units": os.cpu_count(), "memory_bytes": _host_memory_bytes()}


def _cpu_features() -> list[str]:
    try:
        flags = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    table = {"avx2": "avx2", "avx512f": "avx512", "avx512_bf16": "avx512_bf16", "amx_tile": "amx"}
    return [feat for flag, feat in table.items() if flag in flags]


def _base_descriptor(device: torch.device, base: str | None) -> str:
    if base:
        return base
    from portlayer.capabilities.probe import probe_devices

    want = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
    for d in probe_devices():
        if d.torch_device == want and d.descriptor:
            return d.descriptor
    raise RuntimeError(
        f"calibrate: no shipped descriptor matched {want}; pass --base NAME to say which one to start from"
    )


def calibrate(device: str | None = None, base: str | None = None, sizes: Sizes | None = None) -> dict[str, Any]:
    """Run the micro-benchmarks on ``device`` ('cpu', 'cuda', 'cuda:1'; default: best here)."""
    if device is None:
        from portlayer.capabilities.probe import default_target

        device = "cuda" if default_target().device_type == "cuda" else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"calibrate: device {device!r} unsupported; use cpu or cuda[:N]")
    sizes = sizes or (GPU_SIZES if dev.type == "cuda" else CPU_SIZES)
    base_name = _base_descriptor(dev, base)
    raw = load_descriptor(base_name).raw
    facts = _device_facts(dev)
    date = _dt.date.today().isoformat()
    stamp = f"calibrated on {date} on {socket.gethostname()} ({facts['name']}, torch {torch.__version__})"

    bandwidth = measure_copy_bandwidth(dev, sizes)
    measured = {k: v for k in MATMUL_DTYPES
                if (v := measure_matmul(dev, k, sizes)) is not None and math.isfinite(v) and v > 0}
    if "fp32" not in measured:
        raise RuntimeError(f"calibrate: the fp32 matmul on {dev} could not be timed; nothing to calibrate against")
    floor = measured["fp32"] * SLOW_FRACTION
    throughput = {k: v for k, v in measured.items() if v >= floor or k == "fp32"}
    slow = {k: _sig(v) for k, v in measured.items() if k not in throughput}
    launch_us = measure_launch_latency(dev, sizes)

    sources = dict(raw["sources"])
    for key in [k for k in sources if k.startswith("throughput_tflops")]:
        sources[key] = sources[key] + " (datasheet; dtypes without a calibrated entry keep it)"
    patch: dict[str, Any] = {
        "name": f"{base_name}-calibrated",
        "display_name": f"{facts['name']} (calibrated {date})",
        "memory": {"bandwidth_gbps": _sig(bandwidth)},
        "throughput_tflops": {k: _sig(v) for k, v in throughput.items()},
        "launch_overhead_us": _sig(launch_us),
        "compute_units": {"count": int(facts["units"])},
        "calibration": {
            "date": date, "device": facts["name"], "torch": torch.__version__, "host": socket.gethostname(),
            "copy_bytes": sizes.copy_bytes, "matmul_n": sizes.matmul_n, "base_descriptor": base_name,
            "emulated_dtypes_tflops": slow,
        },  # fmt: skip
    }
    sources["memory.bandwidth_gbps"] = f"{stamp}: device-to-device copy of {sizes.copy_bytes} B, (read+write) bytes / time"
    for k in throughput:
        sources[f"throughput_tflops.{k}"] = f"{stamp}: {sizes.matmul_n}^3 matmul"
    sources["launch_overhead_us"] = f"{stamp}: host time per tiny torch op"
    sources["compute_units.count"] = f"{stamp}: reported by the runtime"
    if facts.get("memory_bytes"):
        patch["memory"]["capacity_gb"] = _sig(facts["memory_bytes"] / 1e9)
        sources["memory.capacity_gb"] = f"{stamp}: total memory reported by the runtime"
    if dev.type == "cpu":
        patch["features"] = sorted(set(raw["features"]) | set(_cpu_features()))
        sources["features"] = f"{stamp}: /proc/cpuinfo flags"
    out = deep_merge(raw, patch)
    for k in slow:  # measured far below fp32: the fast path is absent, whatever the datasheet says
        out["throughput_tflops"].pop(k, None)
        sources.pop(f"throughput_tflops.{k}", None)
    out["sources"] = sources
    validate(out, origin=f"calibration of {facts['name']}")
    return out
