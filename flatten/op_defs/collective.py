"""Collective ops for tensor parallelism: ``all_reduce`` and ``all_gather`` across the ranks of the
tensor-parallel group.

Their semantics are torch.distributed's functional collectives over the default process group
(gloo on CPU, NCCL / RCCL / HCCL on accelerators, as the descriptor's ``collectives`` says). With
``world_size`` 1 both are the identity, so a graph sharded for one rank runs anywhere. The
``world_size`` attribute is part of the op (all_gather's output shape depends on it); running an
op for N > 1 ranks without a process group of N ranks is an error that says how to start one.
"""

from __future__ import annotations

from typing import Any

import torch

from portlayer.errors import PortlayerError
from portlayer.flatten.ir import TensorType, normalize_dim, to_sympy
from portlayer.flatten.ops import norm_axis, op, out_numel_flops


class CollectiveError(PortlayerError, RuntimeError):
    """A collective ran outside a process group of the size the graph was sharded for."""


def _group(world_size: int, what: str) -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise CollectiveError(
            f"{what} over {world_size} ranks, but no torch.distributed process group is initialised in this process; "
            "run the artifact with `portlayer run|serve` (which starts the ranks) or under `torchrun --nproc-per-node "
            f"{world_size} -m portlayer ...`"
        )
    if dist.get_world_size() != world_size:
        raise CollectiveError(
            f"{what} was sharded for {world_size} ranks but the process group has {dist.get_world_size()}; "
            f"start {world_size} ranks (torchrun --nproc-per-node {world_size})"
        )
    return dist.group.WORLD


def _same(ins: list[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    return [ins[0]]


@op("all_reduce", kind="data", inputs=("x",), attrs={"reduce": "sum", "world_size": 1}, infer=_same,
    flops=out_numel_flops(1))
def all_reduce(x: torch.Tensor, reduce: str = "sum", world_size: int = 1) -> torch.Tensor:
    """Elementwise ``reduce`` (sum) of ``x`` over the ranks; every rank gets the result."""
    if reduce != "sum":
        raise ValueError(f"all_reduce: reduce {reduce!r} is not supported (only 'sum')")
    if int(world_size) == 1:
        return x
    import torch.distributed._functional_collectives as fc

    y = fc.all_reduce(x.contiguous(), "sum", _group(int(world_size), "all_reduce"))
    return fc.wait_tensor(y)


def _gather_infer(ins: list[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    t = ins[0]
    axis = norm_axis(int(attrs["dim"]), t.rank)
    shape = list(t.shape)
    shape[axis] = normalize_dim(to_sympy(shape[axis]) * int(attrs["world_size"]))
    return [t.with_shape(shape)]


@op("all_gather", kind="data", inputs=("x",), attrs={"dim": -1, "world_size": 1}, infer=_gather_infer,
    flops=out_numel_flops(0))
def all_gather(x: torch.Tensor, dim: int = -1, world_size: int = 1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (rank 0's piece first)."""
    if int(world_size) == 1:
        return x
    import torch.distributed._functional_collectives as fc

    axis = norm_axis(int(dim), x.dim())
    y = fc.wait_tensor(fc.all_gather_single(x.contiguous(), 0, _group(int(world_size), "all_gather")))  # along dim 0
    return torch.cat(torch.chunk(y, int(world_size), dim=0), dim=axis) if axis else y
