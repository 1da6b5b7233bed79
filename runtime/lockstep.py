"""Several runs of one graph, node by node side by side: each weight is read once per node for all of them.

The validation set is four calls of the reference interpreter (prefill, packed, paged prefill and
its decode step). Run one after another, a lazy weight (the float32 view of a bf16 checkpoint) is
made four times; for an 8B model that is most of the reference's time. Here node i runs for every
run before node i+1 runs for any: the weight is made once and handed to each run's op, which is
called with exactly the inputs, attributes and context it gets in a run of its own, so every output
is the same, bit for bit. Runs sharing a paged KV cache are listed in step order: at an attention
node a decode step reads the cache after its prefill step has written that layer (same node, earlier run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from portlayer.flatten.interpret import ExecContext, bound_context, last_uses, run_node
from portlayer.flatten.ir import Graph


def run_lockstep(graph: Graph, runs: Sequence[tuple[Mapping[str, torch.Tensor], Any, Any]],
                 weights: Mapping[str, torch.Tensor], device: torch.device | str = "cpu") -> list[list[torch.Tensor]]:
    """Outputs of ``graph`` for each ``(feeds, attn_metadata, kv_caches)`` run, as ``run_graph`` gives them."""
    ctxs, envs = [], []
    for feeds, md, caches in runs:
        ctxs.append(bound_context(graph, feeds, ExecContext(attn_metadata=md, kv_cache=caches, device=device)))
        envs.append({v.name: feeds[v.name] for v in graph.inputs})
    last_use = last_uses(graph)
    keep = set(graph.outputs) | set(graph.params)
    for i, n in enumerate(graph.nodes):
        read = {x: weights[x] for x in dict.fromkeys(n.inputs) if x is not None and x in graph.params}  # once for all runs
        for env, ctx in zip(envs, ctxs):
            args = [(env[x] if x in env else read[x] if x in read else weights[x]) if x is not None else None
                    for x in n.inputs]
            outs = run_node(n, args, ctx)
            for v, t in zip(n.outputs, outs):
                env[v.name] = t
            for x in n.inputs:
                if x is not None and last_use.get(x) == i and x not in keep:
                    env.pop(x, None)
        del read
    return [[env[o] if o in env else weights[o] for o in graph.outputs] for env in envs]
