"""shard, part 2: the routed experts (``moe_experts``) under tensor parallelism.

Experts are split *inside* each expert, the way vLLM shards fused MoE by default: every rank keeps
all experts, each with 1/N of its intermediate size (the gate and the up rows of ``w_gate_up``
column-parallel, ``w_down`` row-parallel), computes the partial combine of every token's chosen
experts, and the ``all_reduce`` that follows sums the partials. Why this and not expert
parallelism (a subset of experts per rank):

- any expert count works, with no global -> local id mapping and no empty ranks; the work of
  every rank is the same whatever the router picks (expert parallelism is as slow as the rank
  that got the most popular experts);
- the op, its reference and all its lowerings (torch, Triton's fused MoE, CANN's grouped
  matmul) are unchanged: they read the intermediate size from the weights they are given;
- an intermediate size not divisible by N is padded with zero rows and columns, which is exact:
  a padded channel's up row and down column are zero, so it adds act(gate) * 0 * 0 = 0 (every
  activation the op knows is finite at 0).

The router (a replicated linear and the model's own selection ops) and shared experts (ordinary
linears: the MLP rule makes them column / row parallel) need nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass

from portlayer.flatten.ir import Graph, Node
from portlayer.flatten.op_defs.moe import ACTIVATIONS


@dataclass(frozen=True)
class ExpertCut:
    """Which rows of w_gate_up ([E, 2I, H], dim 1) and columns of w_down ([E, H, I], dim 2) one rank keeps;
    -1 marks a zero-padded channel."""

    gate_up: list[int]
    down: list[int]
    per_rank: int


def expert_cut(node: Node, graph: Graph, n: int, rank: int) -> ExpertCut | str:
    """The cut of one moe_experts node for ``rank`` of ``n``, or why it cannot be cut."""
    gu, down = node.inputs[3], node.inputs[4]
    for p in (gu, down):
        if p not in graph.params:
            return f"expert weights {p} of {node.name} are computed, not parameters"
    act = str(node.attrs.get("activation", "silu"))
    if act not in ACTIVATIONS:
        return f"{node.name}'s activation {act!r} is not one the op knows, so padded channels are not proven to add 0"
    e, two_i, _ = graph.params[gu].shape
    inter = int(graph.params[down].shape[2])
    if int(two_i) != 2 * inter or int(graph.params[down].shape[0]) != int(e):
        return f"{node.name}: w_gate_up {graph.params[gu]} and w_down {graph.params[down]} are not [E, 2I, H] / [E, H, I]"
    per = -(-inter // n)
    cols = [c if c < inter else -1 for c in range(rank * per, (rank + 1) * per)]
    rows = cols + [inter + c if c >= 0 else -1 for c in cols]
    return ExpertCut(rows, cols, per)
