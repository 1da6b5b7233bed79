"""Dead-code elimination: drop nodes whose outputs nobody reads, then unused parameters.

Nodes with side effects (attention writes the paged KV cache) stay even when unused,
so removing a dead attention can never change what a later decode step reads.
"""

from __future__ import annotations

from portlayer.flatten.ir import Graph
from portlayer.passes.context import PassContext
from portlayer.passes.util import has_side_effects


def dce(graph: Graph, ctx: PassContext | None = None) -> Graph:
    g = graph.copy()
    live = set(g.outputs)
    kept = []
    for n in reversed(g.nodes):
        if any(v.name in live for v in n.outputs) or has_side_effects(n.op):
            kept.append(n)
            live.update(i for i in n.inputs if i is not None)
    g.nodes = list(reversed(kept))
    dead_params = [p for p in g.params if p not in live]
    for p in dead_params:
        del g.params[p]
        g.weights.pop(p, None)
    return g
