"""The compile/load half of the Triton backends (CUDA, ROCm, XPU), shared by their adapters.

compile_program writes the generated host program and kernels; load_program imports them.
Triton's JIT cache goes under portlayer's cache directory (TRITON_CACHE_DIR), so compiled
kernels live beside portlayer's other cached artifacts and a second load compiles nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch


def triton_cache_dir() -> Path:
    """<portlayer cache>/triton, honouring an explicit TRITON_CACHE_DIR."""
    from portlayer.config import cache_root

    path = Path(os.environ.get("TRITON_CACHE_DIR") or cache_root() / "triton")
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(path)
    return path


def compile_program(result: Any, out_dir: Path | str, descriptor: Any) -> list[Path]:
    """Generate the program for a PipelineResult-like object (graph, plan) into ``out_dir``."""
    from portlayer.backends.generate import generate
    from portlayer.codegen.program import write_program

    plan = getattr(result, "plan", None)
    gen = generate(result.graph, plan, getattr(result, "descriptor", None) or descriptor)
    return write_program(gen, out_dir)


def load_program(artifact_dir: Path | str, weights: Mapping[str, torch.Tensor], device: str,
                 plan: Any = None, **options: Any):
    """The Executable for a compiled artifact (buffers allocated once; CUDA graphs if planned)."""
    from portlayer.codegen.program import load_program as load

    triton_cache_dir()
    if plan is not None:
        options.setdefault("capture_sizes", plan.graph_capture_sizes)
        options.setdefault("step_sizes", plan.step_graph_tokens)
        options.setdefault("max_tokens", plan.max_batched_tokens)
        options.setdefault("max_seqs", plan.max_num_seqs)
    return load(artifact_dir, weights, device, **options)
