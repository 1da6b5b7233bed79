"""Measure the present device and write a descriptor whose numbers say 'calibrated'.

Datasheet peaks are upper bounds a kernel never reaches; the policy and the cost model plan
better on what the device sustains. The micro-benchmarks (calibrate_memory, _launch, _gemm,
_attention; a backend may add its own through ``extra``) fill the measured fields and the
``calibration`` curves; fields a micro-benchmark cannot see (features, alignment, DMA engines,
fence scope) are kept from the shipped descriptor probe matched, and their sources say so.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch

from portlayer.capabilities.calibrate_attention import fit, measure_paged_attention
from portlayer.capabilities.calibrate_gemm import (
    MATMUL_DTYPES,
    TORCH_DTYPES,
    measure_aspects,
    measure_matmul,
    measure_matmuls,
    measure_small_m,
)
from portlayer.capabilities.calibrate_launch import measure_launch_latency, measure_launches
from portlayer.capabilities.calibrate_memory import (
    cache_knee,
    measure_bandwidth_sweep,
    measure_copy_bandwidth,
)
from portlayer.capabilities.calibrate_rounds import merge_rounds, spread_pct
from portlayer.capabilities.calibrate_timing import (
    CPU_FULL,
    CPU_QUICK,
    CPU_SIZES,
    GPU_FULL,
    GPU_QUICK,
    GPU_SIZES,
    Progress,
    Sizes,
    host_clock,
    pinned_threads,
    sig,
    time_per_iter,
)
from portlayer.capabilities.descriptor import deep_merge, load_descriptor, validate

__all__ = [
    "CPU_SIZES", "GPU_SIZES", "MATMUL_DTYPES", "SLOW_FRACTION", "Sizes", "calibrate", "finish", "measure_copy_bandwidth",
    "measure_launch_latency", "measure_matmul", "time_per_iter", "versions",
]  # fmt: skip

SLOW_FRACTION = 1 / 8  # a dtype slower than this share of fp32 is emulated: listed as absent
#: what calibrate measures; every other field of the descriptor is kept from the shipped one
MEASURED = ("memory.bandwidth_gbps", "memory.capacity_gb", "launch_overhead_us", "compute_units.count")
Extra = Callable[[torch.device, Sizes, Progress, str], dict[str, Any]]  # (device, sizes, progress, base name)


def versions() -> dict[str, str]:
    """The toolchain the numbers hold for (a new torch or Triton can change every one)."""
    from portlayer import __version__

    out = {"torch": torch.__version__, "python": platform.python_version(), "portlayer": __version__}
    try:
        out["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        out["triton"] = "absent"
    return out


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


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        from portlayer.capabilities.probe import default_target

        device = "cuda" if default_target().device_type == "cuda" else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"calibrate: device {device!r} unsupported; use cpu or cuda[:N]")
    return dev


def measure(dev: torch.device, sizes: Sizes, progress: Progress, extra: list[Extra] = (), base: str = "") -> dict[str, Any]:
    """Run every benchmark; the raw results (no descriptor yet).

    The backend extras run first: where one measures a curve the way its programs run it (the torch
    family's GEMM through the linear op, its batched attention), the generic benchmark is skipped."""
    sweep = measure_bandwidth_sweep(dev, sizes, progress)
    matmul = measure_matmuls(dev, sizes, progress)
    if "fp32" not in matmul:
        raise RuntimeError(f"calibrate: the fp32 matmul on {dev} could not be timed; nothing to calibrate against")
    got: dict[str, Any] = {}
    for fn in extra:
        try:
            got.update(fn(dev, sizes, progress, base))
        except Exception as e:  # a backend benchmark that breaks costs its numbers, not the calibration
            progress.done(f"failed ({type(e).__name__}: {str(e)[:200]}); the generic benchmark stands in")
    fast = {k: v for k, v in matmul.items() if v >= matmul["fp32"] * SLOW_FRACTION}
    wanted = ("fp32",) if dev.type == "cpu" else ("bf16", "fp16")  # the compute dtypes the policy picks there
    small_k = max(64, sizes.gemm_k // 8)
    if "gemm_curves" not in got:
        got["gemm_curves"] = {k: measure_small_m(dev, k, sizes, progress) for k in wanted if k in fast}
        got["gemm_curves_small"] = {k: measure_small_m(dev, k, sizes, progress, small_k) for k in got["gemm_curves"]}
        got["gemm_small_k"] = small_k
        if dev.type == "cuda" and got["gemm_curves"]:  # the compute dtype's skinny shapes (a ratio: any dtype reads it)
            got["gemm_aspects"] = measure_aspects(dev, next(iter(got["gemm_curves"])), sizes, progress)
    if "attention" not in got:
        compute = next(iter(got["gemm_curves"]), "fp32")
        got["attention"] = measure_paged_attention(dev, sizes, progress, TORCH_DTYPES[compute])
    launch = measure_launches(dev, sizes, progress)
    return {"sweep": sweep, "matmul": matmul, "launch": launch, **got}


def calibrate(device: str | None = None, base: str | None = None, sizes: Sizes | None = None, quick: bool = False,
              progress: Progress | None = None, extra: list[Extra] = (), threads: int | None = None) -> dict[str, Any]:
    """Run the micro-benchmarks on ``device`` ('cpu', 'cuda', 'cuda:1'; default: best here); a valid descriptor.

    ``threads``: torch's intra-op thread count for the run (default: as it is); the numbers hold for
    programs run with the same count, so it is recorded (``calibration.threads``) and `portlayer bench`
    compares it with its own."""
    dev = resolve_device(device)
    if sizes is None:
        sizes = (GPU_QUICK if quick else GPU_FULL) if dev.type == "cuda" else (CPU_QUICK if quick else CPU_FULL)
    progress = progress or Progress(enabled=False)
    base_name = _base_descriptor(dev, base)
    raw = load_descriptor(base_name).raw
    with pinned_threads(threads) as n:
        rounds = []
        for i in range(max(1, sizes.rounds)):
            if sizes.rounds > 1:
                progress.start(f"round {i + 1}/{sizes.rounds}")
                progress.done("the whole suite again; each number keeps its best round")
            rounds.append(measure(dev, sizes, progress, extra, base_name))
        results = merge_rounds(rounds)
        results["threads"], results["clock"] = n, ("CUDA events (device time)" if dev.type == "cuda" else host_clock()[1])
    for key in ("attention", "attention_generated"):  # the fit of the merged points, not the best of three fits
        if results.get(key, {}).get("points"):
            results[key].update(fit(results[key]["points"]))
    seq = results.pop("torch_sequence", None)
    if seq and seq.get("alone_us"):  # the ratio of the merged times (a ratio's best round would be its lowest)
        results["torch_sequence_factor"] = sig(max(1.0, seq["sequence_us"] / seq["alone_us"]), 3)
    if len(rounds) > 1:
        worst = sorted(spread_pct(rounds).items(), key=lambda kv: -kv[1])[:8]
        results["round_spread_pct"] = {k: sig(v, 3) for k, v in worst}
    return finish(raw, base_name, dev, sizes, results, "quick" if quick else "full")


def finish(raw: dict[str, Any], base_name: str, dev: torch.device, sizes: Sizes, results: dict[str, Any],
           mode: str = "full") -> dict[str, Any]:
    """The calibrated descriptor: ``raw`` with the measured fields replaced, every other source marked kept."""
    facts = _device_facts(dev)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    vers = versions()
    host = socket.gethostname()
    stamp = (f"calibrated on {host} at {date} with " + ", ".join(f"{k} {v}" for k, v in vers.items())
             + f" ({facts['name']}, calibrate {mode})")
    measured = results["matmul"]
    throughput = {k: v for k, v in measured.items() if v >= measured["fp32"] * SLOW_FRACTION or k == "fp32"}
    slow = {k: sig(v) for k, v in measured.items() if k not in throughput}
    largest = results["sweep"][-1]
    launch = results["launch"]
    sources = {k: (v if v.startswith("kept from ") else f"kept from {base_name} (not measured): {v}")
               for k, v in raw["sources"].items()}
    patch: dict[str, Any] = {
        "name": f"{base_name}-calibrated",
        "display_name": f"{facts['name']} (calibrated {date[:10]})",
        "memory": {"bandwidth_gbps": sig(largest["copy_gbps"])},
        "throughput_tflops": {k: sig(v) for k, v in throughput.items()},
        "launch_overhead_us": sig(launch["eager_us"]),
        "compute_units": {"count": int(facts["units"])},
        "notes": f"{stamp}. Fields whose source says 'kept from {base_name}' were not measured.",
        "calibration": {
            "date": date, "host": host, "device": facts["name"], "versions": vers, "mode": mode,
            "base_descriptor": base_name, "copy_bytes": sizes.copy_bytes, "matmul_n": sizes.matmul_n,
            "emulated_dtypes_tflops": slow, "bandwidth_sweep": results["sweep"],
            "cache_knee_bytes": cache_knee(results["sweep"]),
            "launch_us": {k: (sig(v) if v is not None else None) for k, v in launch.items()}
            | ({"triton_us": results["triton_launch_us"]} if results.get("triton_launch_us") else {})
            | ({"triton_kernel_us": results["triton_kernel_us"]} if results.get("triton_kernel_us") else {})
            | ({"torch_step_us": results["torch_step_us"]} if results.get("torch_step_us") else {}),
            "gemm_curves": results["gemm_curves"], "gemm_k": sizes.gemm_k, "attention": results["attention"],
            "gemm_cold_bytes": sizes.cold_bytes,
            "gemm_curves_small": results.get("gemm_curves_small", {}), "gemm_small_k": results.get("gemm_small_k"),
            "torch": vers["torch"],
        },  # fmt: skip
    }
    for key in ("gemm_aspects", "gemm_crossover", "attention_generated", "graph_step", "tuning", "threads", "clock", "torch_nodes", "torch_sequence_factor",
                "round_spread_pct"):
        if key in results:
            patch["calibration"][key] = results[key]
    sources["memory.bandwidth_gbps"] = f"{stamp}: device-to-device copy of {largest['bytes']} B, (read+write) bytes / time"
    for k in throughput:
        sources[f"throughput_tflops.{k}"] = f"{stamp}: {sizes.matmul_n}^3 matmul, median of the fastest half of {sizes.reps}"
    sources["launch_overhead_us"] = f"{stamp}: host time per tiny torch op launched eagerly"
    sources["compute_units.count"] = f"{stamp}: reported by the runtime"
    if facts.get("memory_bytes"):
        patch["memory"]["capacity_gb"] = sig(facts["memory_bytes"] / 1e9)
        sources["memory.capacity_gb"] = f"{stamp}: total memory reported by the runtime"
    if results.get("triton_gemm_max_tokens") is not None:
        patch.setdefault("tuning", {})["triton_gemm_max_tokens"] = int(results["triton_gemm_max_tokens"])
        sources["tuning.triton_gemm_max_tokens"] = (f"{stamp}: vendor GEMM vs generated Triton GEMM crossover in M "
                                                    "(calibration.gemm_crossover)")
    if results.get("gemv_max_tokens") is not None and "tuning.gemv_max_tokens" in sources:
        # the bare few-rows kernel against the vendor GEMM leaves out what it fuses (the norm prologue, the
        # epilogue; launches saved): on the H200 it lost at M=1 (14.8 vs 13.2 us at K=N=4096) while the
        # 0.6B shape decodes at 1.28 ms/step with it and 2.13 without. The measured crossover is recorded
        # (calibration.gemm_crossover), the rule stays the shipped descriptor's.
        sources["tuning.gemv_max_tokens"] = (
            f"kept from {base_name}: {raw['sources']['tuning.gemv_max_tokens']} (calibration measured the bare "
            f"few-rows kernel up to M={int(results['gemv_max_tokens'])}, without the fusions it carries: "
            "recorded, not applied)")
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


def run_cli(device: str | None, base: str | None, quick: bool, extra: list[Extra] = (),
            threads: int | None = None) -> dict[str, Any]:
    """What `portlayer calibrate` runs: progress on stderr, a total at the end."""
    progress = Progress(stream=sys.stderr)
    desc = calibrate(device, base=base, quick=quick, progress=progress, extra=extra, threads=threads)
    print(f"calibrate: done in {progress.elapsed:.1f}s ({'quick' if quick else 'full'})", file=sys.stderr)
    return desc
