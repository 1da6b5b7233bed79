"""Find the devices on this machine and match each to a shipped descriptor.

Probing never raises: a missing driver, a CPU-only torch build or a broken vendor
extension becomes a ``skipped`` entry with a reason a person can act on. It runs once
per process because some runtimes (CUDA, torch_npu) are slow or stateful to query.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from portlayer.capabilities.descriptor import Descriptor, list_descriptors, load_descriptor

# Statuses: matched (by name), matched-by-arch (same arch, different SKU), fallback
# (generic descriptor stands in), unmatched (device works, no descriptor fits), skipped.
USABLE = ("matched", "matched-by-arch", "fallback")


@dataclass
class DetectedDevice:
    device_type: str
    index: int
    name: str
    arch: str
    torch_device: str | None
    descriptor: str | None
    status: str
    reason: str
    memory_bytes: int | None = None
    properties: dict[str, Any] = field(default_factory=dict)

    @property
    def usable(self) -> bool:
        return self.status in USABLE and self.torch_device is not None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@functools.cache
def _shipped() -> tuple[Descriptor, ...]:
    return tuple(load_descriptor(n) for n in list_descriptors())


def match_descriptor(device_type: str, name: str, arch: str) -> tuple[str | None, str, str]:
    """(descriptor name, status, reason) for a device; name substrings win over arch."""
    candidates = [d for d in _shipped() if d.device_type == device_type]
    for d in candidates:
        for needle in d.raw.get("match", {}).get("names", []):
            if needle.lower() in name.lower():
                return d.name, "matched", f"device name {name!r} contains {needle!r}"
    for d in candidates:
        if arch in d.raw.get("match", {}).get("arch", []) or arch == d.arch:
            return (
                d.name,
                "matched-by-arch",
                f"no descriptor names {name!r}; same arch {arch} as {d.name}, whose numbers may not fit: "
                f"run `portlayer calibrate -o mine.json` and pass --target mine.json",
            )
    return (
        None,
        "unmatched",
        f"no shipped descriptor for {device_type} device {name!r} (arch {arch}); "
        "copy the closest file in capabilities/devices/ and edit it, or run `portlayer calibrate`",
    )


def _probe_cpu() -> list[DetectedDevice]:
    machine = platform.machine() or "unknown"
    name = _cpu_model_name() or machine
    mem = _host_memory_bytes()
    desc, status, reason = match_descriptor("cpu", name, machine)
    if desc is None:
        desc, status = "cpu-x86_64", "fallback"
        reason = f"no descriptor for a {machine} CPU; using the generic cpu-x86_64 numbers (run `portlayer calibrate`)"
    else:
        status = "matched"
        reason = f"{machine} CPU ({os.cpu_count()} logical cores); generic numbers, `portlayer calibrate` measures this one"
    props = {"logical_cores": os.cpu_count(), "machine": machine}
    return [DetectedDevice("cpu", 0, name, machine, "cpu", desc, status, reason, mem, props)]


def _cpu_model_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _skipped(device_type: str, reason: str) -> DetectedDevice:
    return DetectedDevice(device_type, -1, "-", "-", None, None, "skipped", reason)


def _probe_cuda() -> list[DetectedDevice]:
    import torch

    is_hip = getattr(torch.version, "hip", None) is not None
    kind = "rocm" if is_hip else "cuda"
    if torch.version.cuda is None and not is_hip:
        hint = " (/dev/nvidia0 exists: install a CUDA build of torch)" if Path("/dev/nvidia0").exists() else ""
        return [
            _skipped("cuda", f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None){hint}"),
            _skipped("rocm", f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None)"),
        ]
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as e:  # driver errors surface here
        return [_skipped(kind, f"torch.cuda failed to initialise: {e}")]
    if count == 0:
        node = "/dev/kfd" if is_hip else "/dev/nvidia0"
        missing = "" if Path(node).exists() else f"{node} missing; "
        flag = "--device /dev/kfd --device /dev/dri" if is_hip else "--gpus all"
        return [_skipped(kind, f"torch.cuda.is_available() is False: {missing}no driver or no device. In a container, pass {flag}.")]
    out = []
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        arch = p.gcnArchName.split(":")[0] if is_hip else f"sm_{p.major}{p.minor}"
        desc, status, reason = match_descriptor(kind, p.name, arch)
        props = {"multi_processor_count": p.multi_processor_count, "capability": [p.major, p.minor]}
        out.append(DetectedDevice(kind, i, p.name, arch, f"cuda:{i}", desc, status, reason, p.total_memory, props))
    return out


def _probe_xpu() -> list[DetectedDevice]:
    import torch

    xpu = getattr(torch, "xpu", None)
    available = False
    try:
        available = bool(xpu is not None and xpu.is_available())
    except Exception as e:
        return [_skipped("xpu", f"torch.xpu failed to initialise: {e}")]
    if not available:
        if not Path("/dev/dri/renderD128").exists():
            why = "Intel GPU not detected: /dev/dri/renderD128 missing. In a container, pass --device /dev/dri."
        else:
            why = (
                f"/dev/dri/renderD128 exists but torch {torch.__version__} sees no XPU "
                "(torch.xpu.is_available() is False): install an XPU build of torch and the Level Zero driver."
            )
        return [_skipped("xpu", why)]
    out = []
    for i in range(xpu.device_count()):
        p = xpu.get_device_properties(i)
        arch = "xe-lp" if "UHD" in p.name or "Iris" in p.name else "xe-hpg"
        desc, status, reason = match_descriptor("xpu", p.name, arch)
        mem = getattr(p, "total_memory", None)
        out.append(DetectedDevice("xpu", i, p.name, arch, f"xpu:{i}", desc, status, reason, mem))
    return out


def _probe_npu() -> list[DetectedDevice]:
    """torch_npu is probed only when CANN is present: importing it without CANN breaks torch."""
    if importlib.util.find_spec("torch_npu") is None:
        return [_skipped("ascend", "torch_npu is not installed; Ascend NPUs need torch_npu and the CANN toolkit")]
    home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
    if not home and not Path("/usr/local/Ascend").exists():
        return [
            _skipped(
                "ascend",
                "torch_npu is installed but CANN is not (ASCEND_HOME_PATH unset, /usr/local/Ascend missing); "
                "not importing torch_npu. Source CANN's set_env.sh first.",
            )
        ]
    try:
        import torch
        import torch_npu  # noqa: F401

        count = torch.npu.device_count()  # type: ignore[attr-defined]
    except Exception as e:  # ImportError, OSError (libhccl.so), RuntimeError
        return [_skipped("ascend", f"torch_npu failed to import or initialise: {type(e).__name__}: {e}")]
    if count == 0:
        return [_skipped("ascend", "torch_npu imported but sees no NPU (torch.npu.device_count() == 0)")]
    out = []
    for i in range(count):
        name = torch.npu.get_device_name(i)  # type: ignore[attr-defined]
        arch = "Ascend910B" if name.startswith("Ascend910B") else name
        desc, status, reason = match_descriptor("ascend", name, arch)
        out.append(DetectedDevice("ascend", i, name, arch, f"npu:{i}", desc, status, reason))
    return out


PROBES: dict[str, Callable[[], list[DetectedDevice]]] = {
    "cuda": _probe_cuda,
    "xpu": _probe_xpu,
    "ascend": _probe_npu,
    "cpu": _probe_cpu,
}


def _run_probe(kind: str, fn: Callable[[], list[DetectedDevice]]) -> list[DetectedDevice]:
    try:
        return fn()
    except Exception as e:  # a probe must never take the process down
        return [_skipped(kind, f"probing {kind} raised {type(e).__name__}: {e}")]


BUILTIN_DEVICE_TYPES = ("cpu", "cuda", "rocm", "xpu", "ascend")
_probing = False


def _plugin_devices() -> list[DetectedDevice]:
    """Devices of the device types plugin adapters add, from each adapter's own probe()."""
    from portlayer.capabilities.plugins import plugin_probes

    found: list[DetectedDevice] = []
    for kind, probe in plugin_probes():
        if kind in BUILTIN_DEVICE_TYPES:
            continue  # an alternative adapter for a built-in kind: the built-in probe already ran
        devs = _run_probe(kind, probe)
        if not isinstance(devs, list) or not all(isinstance(d, DetectedDevice) for d in devs):
            devs = [_skipped(kind, f"the {kind!r} plugin's probe() returned {type(devs).__name__}, "
                                   "not a list of DetectedDevice; fix the plugin")]
        found.extend(devs)
    return found


@functools.cache
def _probe_all() -> tuple[DetectedDevice, ...]:
    global _probing
    if _probing:  # a plugin probe that asks probe_devices() sees the built-in devices only
        return tuple(d for kind, fn in PROBES.items() for d in _run_probe(kind, fn))
    _probing = True
    try:
        found: list[DetectedDevice] = []
        for kind, fn in PROBES.items():
            found.extend(_run_probe(kind, fn))
        found.extend(_plugin_devices())
    finally:
        _probing = False
    return tuple(found)


def probe_devices(refresh: bool = False) -> list[DetectedDevice]:
    """Every device type with what was found or why it was skipped (cached per process)."""
    if refresh:
        _probe_all.cache_clear()
    return list(_probe_all())


def _score(dev: DetectedDevice) -> tuple[int, float]:
    if dev.device_type == "cpu":
        return (0, 0.0)
    d = load_descriptor(dev.descriptor) if dev.descriptor else None
    speed = max((d.tflops("bf16") or 0.0, d.tflops("fp16") or 0.0)) if d else 0.0
    return (1, speed)


def default_target(devices: list[DetectedDevice] | None = None) -> Descriptor:
    """The fastest usable device here; the CPU descriptor when no accelerator qualifies."""
    devices = probe_devices() if devices is None else devices
    usable = [d for d in devices if d.usable and d.descriptor]
    if not usable:
        return load_descriptor("cpu-x86_64")
    best = max(usable, key=_score)
    return load_descriptor(best.descriptor)  # type: ignore[arg-type]


def summary_lines(devices: list[DetectedDevice]) -> list[str]:
    """Human lines for `portlayer devices`: what is here, what it matched, why others are not."""
    lines = []
    for d in devices:
        if d.status == "skipped":
            lines.append(f"  {d.device_type:<7} skipped       {d.reason}")
            continue
        mem = f"{d.memory_bytes / 2**30:.1f} GiB" if d.memory_bytes else "? GiB"
        lines.append(
            f"  {d.torch_device:<7} {d.status:<13} {d.name} ({d.arch}, {mem}) -> {d.descriptor or '-'}: {d.reason}"
        )
    return lines
