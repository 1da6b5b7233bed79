"""Per-rank weight shards of a tensor-parallel artifact.

The artifact holds one program (graph.json, the generated sources) and rank 0's weights in the
usual weights.safetensors; rank r > 0 has ``tp/rank{r}.safetensors`` with the same tensor names
and shapes. Every rank's graph is produced by the same pipeline with the shard pass set to that
rank, and the structures are checked identical before anything is written, so "one program"
is a checked fact, not an assumption.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from portlayer.errors import PortlayerError

SHARD_DIR = "tp"


class ShardFileError(PortlayerError):
    """A rank's weight shard is missing or does not match the program."""


def shard_file(rank: int) -> str:
    return f"{SHARD_DIR}/rank{rank}.safetensors"


def world_size(plan: Any) -> int:
    try:
        return int(plan.value("tensor_parallel") or 1)
    except (KeyError, AttributeError):
        return 1


def rank_graphs(graph: Any, result: Any) -> list[dict[str, torch.Tensor]]:
    """Weights of ranks 1..N-1: the pipeline re-run for each rank with rank 0's decisions forced."""
    from portlayer.flatten.serialize import graph_to_json
    from portlayer.passes.pipeline import run_pipeline

    n = world_size(result.plan)
    forced = {**dict(result.plan.overrides), "tensor_parallel": n,
              "compute_dtype": result.plan.compute_dtype, "weight_quantization": result.plan.weight_quantization}
    forced = {k: v for k, v in forced.items() if not k.startswith("quality_gate")}
    want = _structure(graph_to_json(result.graph))
    out = []
    for rank in range(1, n):
        other = run_pipeline(graph, result.descriptor, overrides=forced, options={"tp_rank": rank}).graph
        if _structure(graph_to_json(other)) != want:
            raise ShardFileError(f"tensor parallelism: the pipeline gave rank {rank} a different program than rank 0 "
                                 "(a pass decided on weight values); this model cannot share one program across ranks")
        out.append(dict(other.weights))
    return out


def _structure(doc: Mapping[str, Any]) -> Any:
    return {k: v for k, v in doc.items() if k != "weights"}


def write_shards(writer: Any, weights: list[dict[str, torch.Tensor]]) -> list[Path]:
    """tp/rank{r}.safetensors for r = 1.. under the artifact writer's staging directory."""
    from safetensors.torch import save_file

    paths = []
    for rank, w in enumerate(weights, start=1):
        p = writer.dir / shard_file(rank)
        p.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous().clone() for k, v in w.items()}, str(p))  # tied weights stored twice
        writer.declare(p, "weights")
        paths.append(p)
    return paths


def read_shard(manifest: Any, graph: Any, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights from the verified bytes, checked against the program's parameter types."""
    from safetensors.torch import load

    from portlayer.runtime import artifact as A

    if rank == 0:
        return dict(graph.weights)
    rel = shard_file(rank)
    if rel not in manifest.files:
        raise ShardFileError(f"{manifest.path}: the plan says tensor_parallel > {rank} but {rel} is not in the manifest; "
                             "recompile the artifact")
    try:
        stored = load(A.read_verified_bytes(manifest, rel))
    except Exception as e:  # safetensors raises its own error types for corrupt data
        raise ShardFileError(f"{manifest.path / rel}: not a readable safetensors file ({e}); recompile") from None
    out: dict[str, torch.Tensor] = {}
    for name, t in graph.params.items():
        src = stored.get(name)
        if src is None or tuple(src.shape) != tuple(t.shape) or str(src.dtype) != f"torch.{t.dtype}":
            raise ShardFileError(f"{manifest.path / rel}: parameter {name} is missing or not {t}; recompile")
        out[name] = src
    return out
