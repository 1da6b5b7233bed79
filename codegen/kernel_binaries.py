"""Launch an artifact's precompiled kernel binaries (cubin, hsaco) without Triton's compiler or runtime.

Why not Triton's runtime: a kernel compiled at build time by one Triton (3.9 in CI) must launch on a
device machine that has another Triton (3.6 on the H200), or none; Triton's launcher is itself C code
it compiles into its cache on first use. The binary's ABI, recorded at build time from the PTX /
AMDGPU metadata (codegen/aot.py ``write_binaries``), is all a launch needs: load the image with the
driver (``cuModuleLoadData`` / ``hipModuleLoadData`` through ctypes), pass each runtime argument
in signature order plus Triton's trailing scratch pointers, and launch on torch's current stream
(so CUDA graph capture records it like any other kernel).

:func:`bind` is called where kernels are loaded (codegen/host_support.load_kernels): with a
``binaries.json`` among the verified artifact files and a matching device, each Triton JIT function
is replaced by a :class:`BinaryKernel` with the same ``kernel[grid](*args, **constexprs)`` call
syntax. No binaries (``--sources-only``), the Triton interpreter, a CPU device or
``PORTLAYER_KERNEL_BINARIES=0``: the JIT functions are kept (today's behaviour). Binaries for another
arch or a driver older than the toolchain needs: refused, with expected/found and what to run.
"""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

import torch

from portlayer.errors import PortlayerError

INDEX = "binaries.json"
ENV = "PORTLAYER_KERNEL_BINARIES"
_SCALAR = {"i1": ctypes.c_int8, "i8": ctypes.c_int8, "i16": ctypes.c_int16, "i32": ctypes.c_int32,
           "i64": ctypes.c_int64, "u1": ctypes.c_uint8, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16,
           "u32": ctypes.c_uint32, "u64": ctypes.c_uint64, "fp32": ctypes.c_float, "f32": ctypes.c_float,
           "fp64": ctypes.c_double, "f64": ctypes.c_double}
_WIDTH = {"u8": 8, "b8": 8, "s8": 8, "u16": 16, "b16": 16, "s16": 16, "u32": 32, "b32": 32, "s32": 32, "f32": 32,
          "u64": 64, "b64": 64, "s64": 64, "f64": 64, "ptr": 64}


#: element types whose pointer arguments a shipped binary assumes aligned (codegen/aot.pointer_attrs): the
#: tensors a kernel streams (activations, weights, KV caches). Integer index arrays (positions, slot
#: mappings, block tables, sequence lengths) are read one element a program, and the runtime hands kernels
#: slices of them at any element offset, so their pointers are not assumed aligned.
ALIGNED_ELEMENTS = frozenset({"bf16", "fp16", "fp32", "fp64", "fp8e4nv", "fp8e5", "fp8e4b15", "fp8e4b8", "fp8e5b16"})


def assumes_aligned(arg_type: str) -> bool:
    """Whether a binary is compiled assuming a kernel argument of this signature type is 16-byte aligned."""
    return arg_type.startswith("*") and arg_type[1:] in ALIGNED_ELEMENTS


class KernelBinaryError(PortlayerError):
    """The artifact's kernel binaries do not fit this device or driver, or could not be loaded or launched."""


#: Environment switch for binaries compiled for programmatic dependent launch ("0": launch them as plain kernels,
#: which their gdc_wait allows; the A/B of docs/performance.md's session 12)
PDL_ENV = "PORTLAYER_PDL"
#: cuda.h's CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (a CUlaunchAttributeID, CUDA 12.0+)
_PDL_ATTRIBUTE = 6


# ---- the driver -----------------------------------------------------------------------------------------


class _LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: the id, padding to 8 bytes, then the 64-byte value union (its first int is
    programmaticStreamSerializationAllowed)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig (cuLaunchKernelEx's first argument); ctypes adds the padding before hStream."""

    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


class _Driver:
    """The few CUDA driver / HIP module API calls a launch needs, through ctypes."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        names = ("libcuda.so.1", "libcuda.so") if kind == "cuda" else ("libamdhip64.so", "libamdhip64.so.6")
        for n in names:
            try:
                self.lib = ctypes.CDLL(n)
                break
            except OSError:
                continue
        else:
            raise KernelBinaryError(f"cannot load the {kind} driver library ({' or '.join(names)}); "
                                    "recompile the artifact with --sources-only to JIT on load")
        p = "cu" if kind == "cuda" else "hip"
        self.load_data = getattr(self.lib, f"{p}ModuleLoadData")
        self.get_function = getattr(self.lib, f"{p}ModuleGetFunction")
        self.set_attr = getattr(self.lib, f"{p}FuncSetAttribute")
        self.launch = getattr(self.lib, f"{p}LaunchKernel" if kind == "cuda" else "hipModuleLaunchKernel")
        self.launch.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 6, ctypes.c_uint, ctypes.c_void_p,
                                ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        # cuLaunchKernelEx (CUDA 12.0+): launches with attributes, here programmatic stream serialization
        self.launch_ex = getattr(self.lib, "cuLaunchKernelEx", None) if kind == "cuda" else None
        if self.launch_ex is not None:
            self.launch_ex.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                       ctypes.c_void_p]
        self.driver_version = getattr(self.lib, f"{p}DriverGetVersion")
        self._err = getattr(self.lib, f"{p}GetErrorName" if kind == "cuda" else "hipGetErrorName")

    def check(self, rc: int, what: str) -> None:
        if rc == 0:
            return
        name = ctypes.c_char_p()
        if self.kind == "cuda":
            self._err(rc, ctypes.byref(name))
            text = name.value.decode() if name.value else "?"
        else:
            self._err.restype = ctypes.c_char_p
            text = (self._err(rc) or b"?").decode()
        raise KernelBinaryError(f"{what} failed: {text} ({rc})")

    def version(self) -> int:
        v = ctypes.c_int()
        self.check(self.driver_version(ctypes.byref(v)), "DriverGetVersion")
        return v.value

    def function(self, image: bytes, entry: str, shared: int) -> ctypes.c_void_p:
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.load_data(ctypes.byref(mod), ctypes.c_char_p(image)), f"ModuleLoadData({entry})")
        self.check(self.get_function(ctypes.byref(fn), mod, entry.encode()), f"ModuleGetFunction({entry})")
        if shared > 48 * 1024:  # opt in to more than 48 KiB of dynamic shared memory (attribute 8 in both APIs)
            self.check(self.set_attr(fn, 8, ctypes.c_int(shared)), f"FuncSetAttribute({entry}, shared={shared})")
        return fn


_DRIVERS: dict[str, _Driver] = {}
#: torch's current CUDA/HIP stream as a raw handle, by device index (what Triton's own launcher calls)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _driver(kind: str) -> _Driver:
    if kind not in _DRIVERS:
        _DRIVERS[kind] = _Driver(kind)
    return _DRIVERS[kind]


# ---- one kernel -------------------------------------------------------------------------------------------


def check_abi(name: str, rec: Mapping[str, Any]) -> tuple[list[str], list[str], int]:
    """(runtime argument names, their signature types, number of trailing scratch pointers) of one kernel
    record, after checking the binary's parameter list against the kernel signature (count and widths)."""
    sig = dict((a, t) for a, t in rec["args"])  # ordered: the kernel's parameter order
    runtime = [a for a, t in sig.items() if t != "constexpr"]
    types = [sig[a] for a in runtime]
    params = list(rec["params"] or [])
    extra = len(params) - len(runtime)
    if extra < 1 or any(_WIDTH.get(p, 0) != 64 for p in params[len(runtime):]):
        raise KernelBinaryError(f"{name}: the binary takes {len(params)} parameters ({params}), the signature "
                                f"{len(runtime)} runtime arguments ({runtime}) plus scratch pointers; "
                                "the binaries do not match the kernels: recompile the artifact")
    for a, t, p in zip(runtime, types, params):
        if t.startswith("*"):
            ok = p in ("u64", "b64", "ptr")
        else:
            ok = t in _SCALAR and _WIDTH.get(p) == ctypes.sizeof(_SCALAR[t]) * 8
        if not ok:
            raise KernelBinaryError(f"{name}: argument {a} ({t}) meets binary parameter .{p}; the binaries do "
                                    "not match the kernels: recompile the artifact")
    return runtime, types, extra


class BinaryKernel:
    """``kernel[grid](*args, **constexprs)`` for one precompiled kernel: the call syntax of a Triton JIT
    function, launching the verified binary through the driver."""

    def __init__(self, name: str, rec: Mapping[str, Any], image: bytes, driver: _Driver, device: torch.device,
                 fallback: Any = None) -> None:
        self.name, self.rec, self.device, self.driver = name, rec, device, driver
        # the binary assumes every pointer argument aligned to this many bytes (codegen/aot.POINTER_ALIGN; 0 or
        # absent: an older artifact's unspecialized binary); a launch that breaks it runs ``fallback`` (the JIT)
        self.align_mask = max(0, int(rec.get("pointer_align") or 0) - 1)
        self.fallback = fallback
        self.unaligned_launches = 0
        self.runtime, self.types, self.n_scratch = check_abi(name, rec)
        self.constexprs = dict(rec["constexprs"])
        self.block = int(rec["num_warps"]) * int(rec["warp_size"])
        self.shared = int(rec["shared"])
        self.fn = driver.function(image, rec["entry"], self.shared)
        # compiled with PDL=True (codegen/aot.py, templates/triton/_pdl.j2): launched as a programmatic dependent of
        # the kernel before it, unless PORTLAYER_PDL=0 or the driver has no cuLaunchKernelEx (then a plain launch,
        # whose gdc_wait returns at once)
        self.pdl = (bool(rec.get("pdl")) and getattr(driver, "launch_ex", None) is not None
                    and os.environ.get(PDL_ENV, "1") != "0")
        self._config: _LaunchConfig | None = None
        if self.pdl:
            self._attribute = _LaunchAttribute(id=_PDL_ATTRIBUTE, value=1)
            self._config = _LaunchConfig(block_x=self.block, block_y=1, block_z=1, shared=self.shared,
                                         attrs=ctypes.pointer(self._attribute), num_attrs=1)
        self._scratch: torch.Tensor | None = None
        self._old_scratch: list[torch.Tensor] = []  # outgrown scratch buffers, kept for the graphs that captured them
        # the device whose current stream a launch goes on (the module was loaded into its context here)
        self._index = device.index if device.index is not None else (
            torch.cuda.current_device() if device.type == "cuda" and torch.cuda.is_available() else 0)
        self._setup_params()

    def _setup_params(self) -> None:
        """One ctypes holder per kernel parameter, and the pointer array the driver reads, made once: a
        launch only writes the values (cuLaunchKernel copies them), which keeps an eager launch at ~5 us of
        Python instead of ~38 (building ~15 ctypes objects each time; measured on this CPU). Launches of
        one kernel come from one thread (the engine's), so the holders are never written concurrently."""
        self._pointer = [t.startswith("*") for t in self.types]
        self._aligned = [assumes_aligned(t) and self.align_mask > 0 for t in self.types]
        self._holders: list[Any] = [ctypes.c_uint64() if p else _SCALAR[t]() for p, t in zip(self._pointer, self.types)]
        self._holders += [ctypes.c_uint64() for _ in range(self.n_scratch)]
        self._params = (ctypes.c_void_p * len(self._holders))(*[ctypes.addressof(h) for h in self._holders])
        self._scratch_size = int(self.rec["global_scratch_size"])

    def __repr__(self) -> str:
        return f"<BinaryKernel {self.name} ({self.rec['file']})>"

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **kwargs: Any) -> None:
            self.run(grid, args, kwargs)

        return launch

    def _bind(self, args: tuple, kwargs: Mapping[str, Any]) -> list[Any]:
        values = list(args)
        for a in self.runtime[len(values):]:
            if a not in kwargs:
                raise KernelBinaryError(f"{self.name}: argument {a} missing from the launch")
            values.append(kwargs[a])
        if len(values) != len(self.runtime):
            raise KernelBinaryError(f"{self.name}: {len(values)} arguments, the binary takes {len(self.runtime)}")
        for k, v in kwargs.items():
            if k in self.constexprs and self.constexprs[k] != v:
                raise KernelBinaryError(f"{self.name}: launched with {k}={v!r}, the binary was compiled for "
                                        f"{self.constexprs[k]!r}; recompile the artifact")
            if k == "num_warps" and int(v) != int(self.rec["num_warps"]):
                raise KernelBinaryError(f"{self.name}: num_warps={v}, compiled with {self.rec['num_warps']}")
        return values

    def run(self, grid: Any, args: tuple, kwargs: Mapping[str, Any]) -> None:
        if callable(grid):
            grid = grid({**self.constexprs, **dict(zip(self.runtime, args)), **kwargs})
        n = len(grid)
        gx, gy, gz = int(grid[0]), int(grid[1]) if n > 1 else 1, int(grid[2]) if n > 2 else 1
        if gx * gy * gz == 0:
            return
        if self.fill(args, kwargs, gx * gy * gz):
            self._unaligned(grid, args, kwargs)
            return
        # the raw handle of torch's current stream (the capture stream inside torch.cuda.graph): one C call;
        # torch.cuda.current_stream() builds a Stream object and resolves the device twice (~1/3 of an eager
        # launch's host time on the H200 host, session 10's profile of a 128-token prefill)
        stream = _RAW_STREAM(self._index) if _RAW_STREAM is not None else torch.cuda.current_stream(self._index).cuda_stream
        cfg = self._config
        if cfg is not None:
            cfg.grid_x, cfg.grid_y, cfg.grid_z, cfg.stream = gx, gy, gz, stream
            rc = self.driver.launch_ex(ctypes.byref(cfg), self.fn, self._params, None)
        else:
            rc = self.driver.launch(self.fn, gx, gy, gz, self.block, 1, 1, self.shared, stream, self._params, None)
        if rc:
            self.driver.check(rc, f"launch of {self.name}")

    def fill(self, args: tuple, kwargs: Mapping[str, Any], programs: int = 1) -> int:
        """Write this launch's arguments into the persistent parameter holders (see ``_setup_params``);
        returns the OR of the assumed-aligned pointers' misalignment (non-zero: one breaks the binary's assumption)."""
        values = self._bind(args, kwargs)
        bad = 0
        for h, v, ptr, aligned in zip(self._holders, values, self._pointer, self._aligned):
            if ptr:
                h.value = 0 if v is None else (v.data_ptr() if isinstance(v, torch.Tensor) else int(v))
                if aligned:
                    bad |= h.value
            else:
                h.value = v.item() if isinstance(v, torch.Tensor) else v
        if self._scratch_size:
            self._holders[len(values)].value = self._scratch_ptr(programs)
        return bad & self.align_mask

    def _unaligned(self, grid: Any, args: tuple, kwargs: Mapping[str, Any]) -> None:
        """A pointer the binary assumes aligned is not: Triton's JIT specializes this launch itself."""
        if self.fallback is None:
            raise KernelBinaryError(f"{self.name}: a pointer argument is not {self.align_mask + 1}-byte aligned, which "
                                    "its binary assumes, and no kernel source is loaded to JIT it; recompile with "
                                    "--sources-only")
        if not self.unaligned_launches:
            import warnings

            warnings.warn(f"{self.name}: launched with a pointer not {self.align_mask + 1}-byte aligned; this and "
                          "later such launches run the Triton JIT kernel instead of the binary", stacklevel=3)
        self.unaligned_launches += 1
        self.fallback[grid](*args, **kwargs)

    def pack(self, args: tuple, kwargs: Mapping[str, Any], programs: int = 1) -> list[Any]:
        """The kernel parameters as ctypes values, in the binary's order: runtime arguments, then scratch
        (the persistent holders a launch passes, filled for these arguments)."""
        self.fill(args, kwargs, programs)
        return list(self._holders)

    def _scratch_ptr(self, programs: int) -> int:
        """Triton's global scratch for ``programs`` programs, grown on demand, aligned as the binary asks."""
        need = self._scratch_size * programs + int(self.rec["global_scratch_align"])
        if self._scratch is None or self._scratch.numel() < need:
            if self._scratch is not None:  # a captured CUDA graph may hold its address: never freed
                self._old_scratch.append(self._scratch)
            self._scratch = torch.empty(need, dtype=torch.uint8, device=self.device)
        align = int(self.rec["global_scratch_align"])
        return -(-self._scratch.data_ptr() // align) * align


def match_launch(name: str, records: Seq[Mapping[str, Any]], kwargs: Mapping[str, Any]) -> int:
    """Index of the launch record (kernels.json / binaries.json: constexprs, num_warps) that a launch with
    these keyword arguments runs; KernelBinaryError when none was compiled for it."""
    for i, rec in enumerate(records):
        if (all(kwargs.get(c, v) == v for c, v in rec["constexprs"].items())
                and int(kwargs.get("num_warps", rec["num_warps"])) == int(rec["num_warps"])):
            return i
    given = {c: kwargs[c] for c in records[0]["constexprs"] if c in kwargs}
    raise KernelBinaryError(f"{name}: launched with {given}, the binaries were compiled for "
                            f"{[r['constexprs'] for r in records]}; recompile the artifact")


class BinaryVariants:
    """One kernel compiled for several launch configurations (constexprs, warps): each launch runs the
    binary whose configuration it names, as Triton's JIT would pick (or compile) its specialisation."""

    def __init__(self, name: str, kernels: list[BinaryKernel]) -> None:
        self.name, self.kernels = name, kernels

    def __repr__(self) -> str:
        return f"<BinaryVariants {self.name} ({len(self.kernels)} binaries)>"

    def pick(self, kwargs: Mapping[str, Any]) -> BinaryKernel:
        return self.kernels[match_launch(self.name, [k.rec for k in self.kernels], kwargs)]

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **kwargs: Any) -> None:
            self.pick(kwargs).run(grid, args, kwargs)

        return launch


# ---- binding an artifact's kernels ------------------------------------------------------------------------


def _runtime_kind(device: torch.device) -> str | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return "hsaco" if getattr(torch.version, "hip", None) else "cubin"


def _device_arch(device: torch.device, kind: str) -> str:
    if kind == "cubin":
        major, minor = torch.cuda.get_device_capability(device)
        return str(major * 10 + minor)
    return str(getattr(torch.cuda.get_device_properties(device), "gcnArchName", "?")).split(":")[0]


def check_device(index: Mapping[str, Any], device: torch.device) -> tuple[str, _Driver]:
    """(binary kind, driver) when the binaries fit ``device``; KernelBinaryError (expected/found) otherwise."""
    kind = _runtime_kind(device)
    t, tc = index["target"], index.get("toolchain", {})
    made = f"{index['kind']} for {t['backend']}:{t['arch']} by triton {tc.get('triton', '?')}"
    fix = ("recompile for this device (`portlayer compile MODEL --target <its descriptor>`), or with --sources-only "
           "to JIT-compile the kernel sources on load")
    if kind != index["kind"]:
        raise KernelBinaryError(f"kernel binaries: expected a device that runs {index['kind']} ({made}); found "
                                f"{device} ({kind or 'no binary loader'}); {fix}")
    found = _device_arch(device, kind)
    if str(t["arch"]) != found:
        raise KernelBinaryError(f"kernel binaries: expected arch {t['arch']} ({made}); found {found} on {device} "
                                f"({torch.cuda.get_device_name(device)}); {fix}")
    drv = _driver("cuda" if kind == "cubin" else "hip")
    need = tc.get("cuda_driver_min")
    if kind == "cubin" and need:
        have = drv.version()
        major, minor = (int(x) for x in str(need).split(".")[:2])
        if have < major * 1000 + minor * 10:
            raise KernelBinaryError(f"kernel binaries: expected a CUDA driver >= {need} ({made}, ptxas "
                                    f"{tc.get('ptxas_version', '?')}); found driver {have // 1000}.{have % 1000 // 10}; "
                                    f"update the driver or {fix}")
    return kind, drv


def bind(fns: Mapping[str, Any], sources: Any, device: torch.device | str | None) -> dict[str, Any]:
    """``fns`` (kernel name -> Triton JIT function) with each kernel that has a verified binary replaced by
    a BinaryKernel, when the artifact carries binaries and ``device`` runs them (see the module docstring)."""
    out = dict(fns)
    files = getattr(sources, "files", {})
    if INDEX not in files or device is None or os.environ.get(ENV, "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return out
    device = torch.device(device)
    if device.type != "cuda":
        return out
    try:
        index = json.loads(sources.read(INDEX))
    except (ValueError, UnicodeDecodeError) as e:
        raise KernelBinaryError(f"{sources.root}/{INDEX}: not readable JSON ({e}); recompile the artifact") from None
    if index.get("format") != "portlayer-binaries/1" or index.get("kind") not in ("cubin", "hsaco"):
        raise KernelBinaryError(f"{sources.root}/{INDEX}: format {index.get('format')!r} / kind {index.get('kind')!r} "
                                "is not one this portlayer loads; recompile the artifact")
    _, drv = check_device(index, device)
    torch.cuda.init()
    with torch.cuda.device(device):
        torch.empty(1, device=device)  # make torch's (primary) context current before loading modules
        for name, rec in index["kernels"].items():
            if name not in out:
                continue
            kernels = [BinaryKernel(name, r, sources.read(r["file"]), drv, device, fallback=out[name])
                       for r in (rec, *rec.get("variants", ()))]
            out[name] = kernels[0] if len(kernels) == 1 else BinaryVariants(name, kernels)
    return out
