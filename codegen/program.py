"""Write generated programs to an artifact directory and load them back as Executables.

Layout: <out>/host.py (the program), <out>/program.json (its layout: weights, arena buffers
from the memory plan, per-layer namespaces), <out>/kernels/<name>.py (one Triton kernel module
each), <out>/kernels.json (launch configs and signatures, for AOT builds and inspection).
Generating a program is backends/generate.py's job (it needs the lowering registry).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from portlayer.codegen.host import GeneratedProgram

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
        meta = {n: {"family": k.family, "fn": k.fn, "signature": k.signature(), "constexprs": k.constexprs,
                    "num_warps": k.num_warps, "num_stages": k.num_stages, "module": k.extra.get("module", n)}
                for n, k in gen.kernels.items()}
        (out / "kernels.json").write_text(json.dumps({"kernels": meta, "fallbacks": gen.fallbacks}, indent=2))
        files.append(out / "kernels.json")
    return files


def read_layout(out_dir: Path | str) -> dict[str, Any]:
    path = Path(out_dir) / PROGRAM_LAYOUT
    try:
        layout = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the program layout ({e}); recompile the artifact") from e
    if not isinstance(layout, dict) or layout.get("format") != "portlayer-program/1":
        raise ValueError(f"{path}: not a portlayer program layout (format portlayer-program/1); recompile the artifact")
    return layout


def load_program(out_dir: Path | str, weights: Mapping[str, torch.Tensor], device: torch.device | str = "cpu",
                 **options: Any):
    """Import <out_dir>/host.py and build its Program (allocates buffers once)."""
    out = Path(out_dir)
    name = f"portlayer_host_{abs(hash(str(out.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, out / "host.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod.Program(weights, device, layout=read_layout(out), kernels_dir=out / "kernels", **options)
