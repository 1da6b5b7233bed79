"""Write generated programs to an artifact directory and load them back as Executables.

Layout: <out>/host.py (the program), <out>/kernels/<name>.py (one Triton kernel module
each), <out>/kernels.json (launch configs and signatures, for AOT builds and inspection).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from portlayer.codegen.gemm_rule import triton_gemm_max_tokens
from portlayer.codegen.host import GeneratedProgram, generate_torch_program, generate_triton_program
from portlayer.codegen.kernels.context import GenContext
from portlayer.flatten.ir import Graph

if TYPE_CHECKING:
    from portlayer.codegen.source_loader import VerifiedSources


def context_for(graph: Graph, plan: Any, descriptor: Any) -> GenContext:
    """Codegen context from the Plan's launch configs and the descriptor's facts."""
    launch = {}
    if plan is not None:
        try:
            launch = plan.launch_configs
        except KeyError:
            launch = {}
    return GenContext(graph, launch, warp_size=descriptor.warp_size, compute_units=descriptor.compute_units.count,
                      triton_gemm_max_tokens=triton_gemm_max_tokens(descriptor))


def generate(graph: Graph, plan: Any, descriptor: Any) -> GeneratedProgram:
    if descriptor.codegen == "triton":
        return generate_triton_program(graph, context_for(graph, plan, descriptor), target=descriptor.name)
    if descriptor.codegen == "cann":  # Ascend: a torch_npu op-call program (codegen/cann.py)
        from portlayer.codegen.cann import generate_cann_program

        return generate_cann_program(graph, plan, descriptor)
    return generate_torch_program(graph, target=descriptor.name)


def write_program(gen: GeneratedProgram, out_dir: Path | str) -> list[Path]:
    out = Path(out_dir)
    (out / "kernels").mkdir(parents=True, exist_ok=True)
    for stale in (out / "kernels").glob("*.py"):
        stale.unlink()
    files = [out / "host.py"]
    files[0].write_text(gen.host)
    for name, src in gen.kernel_sources().items():
        p = out / "kernels" / f"{name}.py"
        p.write_text(src)
        files.append(p)
    meta = {n: {"family": k.family, "fn": k.fn, "signature": k.signature(), "constexprs": k.constexprs,
                "num_warps": k.num_warps, "num_stages": k.num_stages, "module": k.extra.get("module", n)}
            for n, k in gen.kernels.items()}
    (out / "kernels.json").write_text(json.dumps({"kernels": meta, "fallbacks": gen.fallbacks}, indent=2))
    files.append(out / "kernels.json")
    return files


def load_program(out_dir: Path | str, weights: Mapping[str, torch.Tensor], device: torch.device | str = "cpu",
                 sources: VerifiedSources | None = None, **options: Any):
    """Build the Program of <out_dir>/host.py (allocates buffers once).

    ``sources``: the artifact's generated files as verified at load time (portlayer.load
    passes them); host.py and its kernels then run from those bytes only. Without it the
    directory is one the caller just generated: its sources are read once, never imported.
    """
    from portlayer.codegen.source_loader import module_name, read_directory

    out = Path(out_dir).resolve()
    src = sources if sources is not None else read_directory(out)
    mod = src.exec_module(out / "host.py", module_name(src, out / "host.py", "portlayer_host"))
    return mod.Program(weights, device, kernels_dir=out / "kernels", sources=src, **options)
