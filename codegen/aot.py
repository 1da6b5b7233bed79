"""Ahead-of-time compilation of generated kernels for GPU targets, without a GPU.

``python -m portlayer.codegen.aot ARTIFACT_DIR --target sm90 ...`` compiles every
kernel listed in ARTIFACT_DIR/kernels.json with triton.compile and prints a JSON report
(binary kind and size, shared memory, registers where reported). It runs as its own
process because Triton fixes interpreted-or-compiled when triton.language is imported.

``--write-binaries`` (one target) also writes each kernel's binary to ARTIFACT_DIR/binaries/ and
the launch metadata to ARTIFACT_DIR/binaries.json (codegen/kernel_binaries.py loads them), compiling
kernels in parallel (``--jobs``). PyPI Triton ships the nvidia and amd backends; Intel XPU (SPIR-V)
compiles through triton-xpu in its own environment (codegen/xpu_toolchain.py runs this module there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from portlayer.errors import PortlayerError

#: descriptor device_type -> the Triton backend that compiles for it (PyPI Triton ships cuda and hip;
#: xpu needs triton-xpu, see codegen/xpu_toolchain.py).
TRITON_BACKENDS = {"cuda": "cuda", "rocm": "hip", "xpu": "xpu"}
BINARY = {"cuda": "cubin", "hip": "hsaco", "xpu": "spv"}
BINARIES_INDEX = "binaries.json"


class BinaryBuildError(PortlayerError):
    """The kernels of an artifact did not compile to the target's binaries (the message has the compiler's
    last lines and the --sources-only way out)."""

BINARIES_DIR = "binaries"


def descriptor_target(desc: Any) -> tuple[str, str, tuple[str, Any, int]] | None:
    """(alias such as 'sm90' or 'gfx942', descriptor name, GPUTarget triple) from a descriptor's
    device_type, arch and warp_size; None when no installed Triton backend compiles for it."""
    backend = TRITON_BACKENDS.get(desc.device_type)
    if backend is None or desc.codegen != "triton":
        return None
    if backend == "cuda":
        digits = desc.arch.removeprefix("sm_")
        if not digits.isdigit():
            return None
        return f"sm{digits}", desc.name, ("cuda", int(digits), desc.warp_size)
    if backend == "xpu":
        from portlayer.codegen.xpu_toolchain import xpu_properties

        return desc.arch, desc.name, ("xpu", xpu_properties(desc), desc.warp_size)
    return desc.arch, desc.name, ("hip", desc.arch, desc.warp_size)


def targets() -> dict[str, tuple[str, Any, int]]:
    """Alias -> GPUTarget triple for every shipped descriptor Triton can compile for here.

    Derived from the descriptors' arch and warp fields (one entry per arch), so a new
    descriptor is a new AOT target without touching this file.
    """
    from portlayer.capabilities.descriptor import list_descriptors, load_descriptor

    out: dict[str, tuple[str, Any, int]] = {}
    for name in list_descriptors():
        t = descriptor_target(load_descriptor(name))
        if t is not None and t[2][0] != "xpu":  # xpu compiles only in triton-xpu's environment
            out.setdefault(t[0], t[2])
    return out


def parse_target(text: str) -> tuple[str, Any, int]:
    """An alias ('sm90', 'gfx942'), a descriptor name or .json path, or 'backend:arch:warp'."""
    known = targets()
    if text in known:
        return known[text]
    if text.count(":") == 2:
        backend, arch, warp = text.split(":")
        return backend, int(arch) if arch.isdigit() else arch, int(warp)
    from portlayer.capabilities.descriptor import DescriptorError, load_descriptor

    try:
        t = descriptor_target(load_descriptor(text))
    except DescriptorError as e:
        raise SystemExit(f"--target {text!r}: not an AOT target ({', '.join(sorted(known))}), "
                         f"'backend:arch:warp', or a loadable descriptor ({e})") from None
    if t is None:
        raise SystemExit(f"--target {text!r}: its descriptor is not a CUDA or ROCm Triton target; PyPI Triton "
                         f"compiles only for {', '.join(sorted(known))}")
    return t[2]


#: Every float-tensor pointer argument of a shipped binary is compiled as POINTER_ALIGN-byte aligned, as Triton's JIT
#: specializes a launch whose tensors are (tt.divisibility 16): without it every load and store of the
#: binary is scalar (2-byte ld.global.b16 in the bf16 GEMV, attention and norm kernels, checked in the PTX),
#: where the JIT emits 16-byte vector accesses. The launcher checks each launch's pointers
#: (codegen/kernel_binaries.py) and runs the JIT kernel for one that is not aligned.
POINTER_ALIGN = 16

#: The descriptor feature that makes shipped binaries launch as programmatic dependents (templates/triton/_pdl.j2).
PDL_FEATURE = "programmatic_dependent_launch"


def pointer_attrs(signature: Mapping[str, str]) -> dict[tuple[int, ...], list[list[Any]]]:
    """ASTSource ``attrs``: each float-tensor pointer parameter (by position) divisible by POINTER_ALIGN bytes
    (kernel_binaries.assumes_aligned: integer index arrays arrive as slices at any offset)."""
    from portlayer.codegen.kernel_binaries import assumes_aligned

    return {(i,): [["tt.divisibility", POINTER_ALIGN]] for i, t in enumerate(signature.values())
            if assumes_aligned(str(t))}


def _module(path: Path):
    """Execute one kernel module from its bytes (read once; no import, no bytecode in the artifact)."""
    from portlayer.codegen.source_loader import module_name, read_directory

    src = read_directory(path.parent, (path.name,))
    return src.exec_module(path, module_name(src, path, "aot"))


def compile_artifact(artifact: Path, targets: list[tuple[str, Any, int]]) -> list[dict[str, Any]]:
    import triton
    from triton.backends.compiler import GPUTarget

    info = json.loads((artifact / "kernels.json").read_text())["kernels"]
    report = []
    for name, k in sorted(x for n, base in sorted(info.items()) for x in launches(n, base)):
        mod = _module(artifact / "kernels" / f"{k['module']}.py")
        fn = getattr(mod, k["fn"])
        sig = dict(k["signature"])
        for backend, arch, warp in targets:
            t0 = time.time()
            row: dict[str, Any] = {"kernel": name, "target": f"{backend}:{arch}:{warp}"}
            try:
                src = triton.compiler.ASTSource(fn, signature=sig, constexprs=dict(k["constexprs"]),
                                                attrs=pointer_attrs(sig))
                c = triton.compile(src, target=GPUTarget(backend, arch, warp),
                                   options={"num_warps": k["num_warps"], "num_stages": k["num_stages"]})
                binary = c.asm[BINARY[backend]]
                row.update(ok=True, bytes=len(binary), shared=c.metadata.shared,
                           n_regs=getattr(c, "n_regs", None))
            except Exception as e:  # report every failure, not just the first
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
            row["seconds"] = round(time.time() - t0, 3)
            report.append(row)
    return report


# ---- binaries shipped in the artifact ----------------------------------------------------------------

#: CUDA binaries for sm_80..sm_90 are assembled by Triton's bundled CUDA 12.9 ptxas at PTX ISA 8.8, so the
#: cubin loads on any CUDA 12.x or newer driver (minor-version compatibility); Triton 3.9 would otherwise
#: use its CUDA 13 ptxas for sm_90, whose cubins need a CUDA 13 driver.
LEGACY_PTX_VERSION = 88
CUDA_DRIVER_MIN = "12.0"


def _ptx_params(ptx: str, entry: str) -> list[str]:
    import re

    m = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\(([^)]*)\)", ptx, re.S)
    if m is None:
        raise RuntimeError(f"no .entry {entry} in the PTX")
    return [re.match(r"\s*\.param\s+\.(\w+)", p)[1] for p in m[1].split(",") if p.strip()]  # type: ignore[index]


def _amd_params(amdgcn: str) -> list[str]:
    import re

    block = amdgcn[amdgcn.find(".args:"):amdgcn.find(".group_segment_fixed_size")]
    out = []
    for item in block.split("- ")[1:]:
        size = int(re.search(r"\.size:\s+(\d+)", item)[1])  # type: ignore[index]
        out.append("ptr" if "global_buffer" in item else f"b{size * 8}")
    return out


def _toolchain(backend: str, arch: Any) -> dict[str, Any]:
    import triton

    tc: dict[str, Any] = {"triton": triton.__version__}
    if backend == "cuda":
        import subprocess

        from triton.backends.nvidia.compiler import get_ptxas

        _prefer_legacy_ptxas(int(arch))
        tool = get_ptxas(int(arch))
        text = subprocess.run([tool.path, "--version"], capture_output=True, text=True).stdout
        tc.update(ptxas=text.strip().splitlines()[-1] if text.strip() else "?", ptxas_version=tool.version,
                  ptx_version=_ptx_version(int(arch)) if int(arch) < 100 else None,
                  cuda_driver_min=CUDA_DRIVER_MIN if int(arch) < 100 else tool.version.rsplit(".", 1)[0])
    elif backend == "hip":
        tc.update(linker="triton's in-process amd.link_hsaco (no ROCm install)")
    return tc


def _ptx_version(arch: int) -> int:
    """LEGACY_PTX_VERSION, or lower when the ptxas at hand is older (Triton 3.6 bundles CUDA 12.8: PTX 8.7)."""
    from triton.backends.nvidia.compiler import get_ptxas, ptx_get_version

    return min(LEGACY_PTX_VERSION, ptx_get_version(get_ptxas(arch).version))


def _prefer_legacy_ptxas(arch: int) -> None:
    """Point Triton's sm_90+ ptxas at its bundled CUDA 12.9 one (see LEGACY_PTX_VERSION)."""
    if arch < 100:
        from triton import knobs

        os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = knobs.nvidia.ptxas.path


def launches(name: str, k: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(binary name, kernel record) per launch configuration of one kernels.json entry: the kernel itself,
    then ``NAME.vI`` for each variant (the same module compiled with other constexprs / warps)."""
    base = {a: b for a, b in k.items() if a != "variants"}
    return [(name, base)] + [(f"{name}.v{i}", {**base, **v}) for i, v in enumerate(k.get("variants", ()), 1)]


def _with_variants(records: list[dict[str, Any]]) -> dict[str, Any]:
    """binaries.json's kernels: one record per kernel; its other launch configurations under ``variants``."""
    out: dict[str, Any] = {}
    for r in records:
        name = r.pop("kernel")
        base, _, _ = name.partition(".v")
        if base == name:
            out[name] = r
        else:
            out[base].setdefault("variants", []).append(r)
    return out


def _compile_one(job: tuple[str, str, dict[str, Any], tuple[str, Any, int], bool]) -> dict[str, Any]:
    """Worker: one kernel for one target; writes the binary, returns its launch record."""
    import hashlib

    import triton
    from triton.backends.compiler import GPUTarget

    artifact, name, k, (backend, arch, warp), pdl = job
    art = Path(artifact)
    t0 = time.time()
    opts: dict[str, Any] = {"num_warps": k["num_warps"], "num_stages": k["num_stages"]}
    if backend == "cuda":
        _prefer_legacy_ptxas(int(arch))
        if int(arch) < 100:
            opts["ptx_version"] = _ptx_version(int(arch))
    mod = _module(art / "kernels" / f"{k['module']}.py")
    sig = dict(k["signature"])
    const = dict(k["constexprs"])
    if "PDL" in sig:  # templates/triton/_pdl.j2: set here, whatever kernels.json says
        const["PDL"] = bool(pdl)
    src = triton.compiler.ASTSource(getattr(mod, k["fn"]), signature=sig, constexprs=const, attrs=pointer_attrs(sig))
    c = triton.compile(src, target=GPUTarget(backend, arch, warp), options=opts)
    md = c.metadata
    binary = c.asm[BINARY[backend]]
    data = binary if isinstance(binary, bytes) else binary.encode()
    rel = f"{BINARIES_DIR}/{name}.{BINARY[backend]}"
    (art / rel).write_bytes(data)
    if backend == "cuda":
        params = _ptx_params(c.asm["ptx"], md.name)
    elif backend == "hip":
        params = _amd_params(c.asm["amdgcn"])
    else:
        params = None
    return {"kernel": name, "file": rel, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
            "entry": md.name, "num_warps": md.num_warps, "num_stages": k["num_stages"], "warp_size": warp,
            "shared": md.shared, "global_scratch_size": getattr(md, "global_scratch_size", 0) or 0,
            "global_scratch_align": getattr(md, "global_scratch_align", 1) or 1,
            "profile_scratch_size": getattr(md, "profile_scratch_size", 0) or 0, "params": params,
            "args": [[a, t] for a, t in k["signature"].items()],  # a list: argument ORDER is the launch ABI
            "constexprs": const, "pointer_align": POINTER_ALIGN, "pdl": pdl, "seconds": round(time.time() - t0, 3)}


def write_binaries(artifact: Path, target: tuple[str, Any, int], jobs: int | None = None,
                   pdl: bool = False) -> dict[str, Any]:
    """Compile every kernel of ``artifact`` for ``target`` in parallel; write binaries/ and binaries.json.
    ``pdl``: compile for programmatic dependent launch (the descriptor's programmatic_dependent_launch feature)."""
    from concurrent.futures import ProcessPoolExecutor

    info = json.loads((artifact / "kernels.json").read_text())["kernels"]
    (artifact / BINARIES_DIR).mkdir(exist_ok=True)
    backend, arch, warp = target
    work = [(str(artifact), vname, v, target, pdl) for name, k in sorted(info.items()) for vname, v in launches(name, k)]
    n = max(1, min(jobs or os.cpu_count() or 1, len(work), 16))
    t0 = time.time()
    if n == 1:
        records = [_compile_one(w) for w in work]
    else:
        with ProcessPoolExecutor(max_workers=n) as pool:
            records = list(pool.map(_compile_one, work))
    index = {"format": "portlayer-binaries/1", "kind": BINARY[backend],
             "target": {"backend": backend, "arch": arch, "warp_size": warp},
             "toolchain": _toolchain(backend, arch), "jobs": n, "seconds": round(time.time() - t0, 3),
             "kernels": _with_variants(records)}
    (artifact / BINARIES_INDEX).write_text(json.dumps(index, indent=1))
    return index


def build_binaries(artifact: Path, desc: Any, jobs: int | None = None, timeout: float = 900) -> list[Path] | None:
    """Compile the kernels of a just-generated artifact directory for ``desc`` in a child process (Triton
    must not be in interpreter mode; XPU runs in triton-xpu's environment). Returns the files written
    (binaries/*, binaries.json), or None when ``desc`` is not a Triton GPU target. A failed compile raises:
    an artifact for a GPU target never silently ships without its binaries."""
    import subprocess

    t = descriptor_target(desc)
    if t is None or not (artifact / "kernels.json").is_file():
        return None
    backend, arch, warp = t[2]
    args = [str(artifact), "--target-json", json.dumps([backend, arch, warp]), "--write-binaries"]
    if desc.has(PDL_FEATURE):
        args.append("--pdl")
    if jobs:
        args += ["--jobs", str(jobs)]
    if backend == "xpu":
        from portlayer.codegen.xpu_toolchain import XPUToolchainError, run_aot

        try:
            r = run_aot(args, timeout=timeout)
        except XPUToolchainError as e:
            raise BinaryBuildError(str(e)) from None
    else:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        r = subprocess.run([sys.executable, "-m", "portlayer.codegen.aot", *args], env=env, capture_output=True,
                           text=True, timeout=timeout)
    if r.returncode:
        lines = [x for x in (r.stderr or r.stdout).strip().splitlines() if "Warning" not in x and "warn_once" not in x]
        raise BinaryBuildError(f"compiling the {BINARY[backend]} kernel binaries for {desc.name} failed (rc {r.returncode}):\n"
                           + "\n".join(lines[-15:]) + "\nCompile with --sources-only to ship the kernel sources only "
                           "(JIT-compiled on the device).")
    index = json.loads((artifact / BINARIES_INDEX).read_text())
    return [artifact / BINARIES_INDEX] + [artifact / r["file"] for k in index["kernels"].values()
                                          for r in (k, *k.get("variants", ()))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--target", action="append", default=[],
                    help=f"{' | '.join(sorted(targets()))} | a descriptor name | backend:arch:warp (default: all)")
    ap.add_argument("--target-json", default=None, help='one target as JSON [backend, arch, warp_size]')
    ap.add_argument("--write-binaries", action="store_true", help="write binaries/ + binaries.json (one --target)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile processes (default: CPU count)")
    ap.add_argument("--pdl", action="store_true", help="compile for programmatic dependent launch (sm_90+)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET to compile ahead of time", file=sys.stderr)
        return 2
    if args.target_json:
        args.target = [tuple(json.loads(args.target_json))]
    if args.write_binaries:
        if len(args.target) != 1:
            print("--write-binaries takes exactly one --target", file=sys.stderr)
            return 2
        tgt = args.target[0]
        index = write_binaries(args.artifact, tgt if isinstance(tgt, tuple) else parse_target(tgt), args.jobs,
                               pdl=args.pdl)
        print(json.dumps({"kind": index["kind"], "kernels": len(index["kernels"]), "seconds": index["seconds"],
                          "toolchain": index["toolchain"]}))
        return 0
    report = compile_artifact(args.artifact, [t if isinstance(t, tuple) else parse_target(t)
                                              for t in args.target or list(targets())])
    print(json.dumps(report))
    return 0 if all(r["ok"] for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
