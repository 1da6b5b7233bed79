"""Ahead-of-time compilation of generated kernels for GPU targets, without a GPU.

``python -m portlayer.codegen.aot ARTIFACT_DIR --target sm90 ...`` compiles every
kernel listed in ARTIFACT_DIR/kernels.json with triton.compile and prints a JSON report
(binary kind and size, shared memory, registers where reported). It runs as its own
process because Triton fixes interpreted-or-compiled when triton.language is imported.
Intel XPU cannot be compiled here: PyPI Triton ships only the nvidia and amd backends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

#: descriptor device_type -> the Triton backend that compiles for it (PyPI Triton ships these two).
TRITON_BACKENDS = {"cuda": "cuda", "rocm": "hip"}
BINARY = {"cuda": "cubin", "hip": "hsaco"}


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
        if t is not None:
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
    for name, k in sorted(info.items()):
        mod = _module(artifact / "kernels" / f"{k['module']}.py")
        fn = getattr(mod, k["fn"])
        sig = dict(k["signature"])
        for backend, arch, warp in targets:
            t0 = time.time()
            row: dict[str, Any] = {"kernel": name, "target": f"{backend}:{arch}:{warp}"}
            try:
                src = triton.compiler.ASTSource(fn, signature=sig, constexprs=dict(k["constexprs"]))
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--target", action="append", default=[],
                    help=f"{' | '.join(sorted(targets()))} | a descriptor name | backend:arch:warp (default: all)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET to compile ahead of time", file=sys.stderr)
        return 2
    report = compile_artifact(args.artifact, [parse_target(t) for t in args.target or list(targets())])
    print(json.dumps(report))
    return 0 if all(r["ok"] for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
