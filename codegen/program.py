"""Write generated programs to an artifact directory and load them back as Executables.

Layout: <out>/host.py (the program), <out>/program.json (its layout: weights, arena buffers
from the memory plan, per-layer namespaces), <out>/kernels/<name>.py (one Triton kernel module
each), <out>/kernels.json (launch configs and signatures, for AOT builds and inspection).
Generating a program is backends/generate.py's job (it needs the lowering registry).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from portlayer.codegen.host import GeneratedProgram

if TYPE_CHECKING:
    from portlayer.codegen.source_loader import VerifiedSources
    from portlayer.codegen.spec import KernelSpec

PROGRAM_LAYOUT = "program.json"


def write_program(gen: GeneratedProgram, out_dir: Path | str) -> list[Path]:
    out = Path(out_dir)
    files = [out / "host.py", out / PROGRAM_LAYOUT]
    out.mkdir(parents=True, exist_ok=True)
    files[0].write_text(gen.host)
    files[1].write_text(json.dumps(gen.layout, indent=1, sort_keys=True))
    sources = gen.kernel_sources()
    if sources:
        (out / "kernels").mkdir(parents=True, exist_ok=True)
        for stale in (out / "kernels").glob("*.py"):
            stale.unlink()
        for name, src in sources.items():
            p = out / "kernels" / f"{name}.py"
            p.write_text(src)
            files.append(p)
        meta = {n: launch_records(n, k) for n, k in gen.kernels.items()}
        (out / "kernels.json").write_text(json.dumps({"kernels": meta, "fallbacks": gen.fallbacks}, indent=2))
        files.append(out / "kernels.json")
    return files


def compiled(spec: KernelSpec) -> dict[str, Any]:
    """The constexprs a binary of ``spec`` is compiled with: the launch's, and PDL (a plain launch; codegen/aot.py sets
    it for a descriptor with the programmatic_dependent_launch feature). The host program never passes PDL."""
    return {**spec.constexprs, "PDL": False}


def launch_records(name: str, spec: KernelSpec) -> dict[str, Any]:
    """kernels.json's entry for one kernel: its first launch configuration, the others under ``variants``
    (codegen/aot.py compiles one binary per configuration)."""
    first, *rest = spec.launches()
    rec = {"family": spec.family, "fn": spec.fn, "signature": first.signature(), "constexprs": compiled(first),
           "num_warps": first.num_warps, "num_stages": first.num_stages, "module": spec.extra.get("module", name)}
    if rest:
        rec["variants"] = [{"signature": v.signature(), "constexprs": compiled(v), "num_warps": v.num_warps,
                            "num_stages": v.num_stages} for v in rest]
    return rec


def read_layout(out_dir: Path | str, data: bytes | None = None) -> dict[str, Any]:
    """The program layout of ``out_dir`` (``data``: its verified bytes, instead of reading the file)."""
    path = Path(out_dir) / PROGRAM_LAYOUT
    try:
        layout = json.loads(data if data is not None else path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{path}: cannot read the program layout ({e}); recompile the artifact") from e
    if not isinstance(layout, dict) or layout.get("format") != "portlayer-program/1":
        raise ValueError(f"{path}: not a portlayer program layout (format portlayer-program/1); recompile the artifact")
    return layout


def load_program(out_dir: Path | str, weights: Mapping[str, torch.Tensor], device: torch.device | str = "cpu",
                 sources: VerifiedSources | None = None, **options: Any):
    """Build the Program of <out_dir>/host.py (allocates buffers once).

    ``sources``: the artifact's generated files as verified at load time (portlayer.load
    passes them); host.py, program.json and the kernels then come from those bytes only.
    Without it the directory is one the caller just generated: its files are read once,
    never imported (no module import from the directory, no bytecode read or written there).
    """
    from portlayer.codegen.source_loader import module_name, read_directory

    out = Path(out_dir).resolve()
    src = sources if sources is not None else read_directory(out, ("*.py", PROGRAM_LAYOUT, "kernels/*.py"))
    mod = src.exec_module(out / "host.py", module_name(src, out / "host.py", "portlayer_host"))
    layout = read_layout(out, src.read(out / PROGRAM_LAYOUT))
    return mod.Program(weights, device, layout=layout, kernels_dir=out / "kernels", sources=src, **options)
