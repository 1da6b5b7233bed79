"""Common-subexpression elimination: a node equal to an earlier one (same op, inputs and
attributes) is replaced by it. Commutative binary ops match with swapped operands.
Side-effecting ops (attention) are never merged."""

from __future__ import annotations

import json

from portlayer.flatten.ir import Graph
from portlayer.flatten.rewrite import COMMUTATIVE
from portlayer.passes.context import PassContext
from portlayer.passes.util import has_side_effects


def _key(op: str, inputs: list[str | None], attrs: dict) -> str:
    ins = list(inputs)
    if op in COMMUTATIVE and len(ins) == 2 and None not in ins:
        ins = sorted(ins)  # type: ignore[type-var]
    return json.dumps([op, ins, attrs], sort_keys=True, default=str)


def cse(graph: Graph, ctx: PassContext | None = None) -> Graph:
    g = graph.copy()
    seen: dict[str, list[str]] = {}
    rename: dict[str, str] = {}
    kept = []
    for n in g.nodes:
        n.inputs = [rename.get(i, i) if i is not None else None for i in n.inputs]
        if has_side_effects(n.op):
            kept.append(n)
            continue
        k = _key(n.op, n.inputs, n.attrs)
        if k in seen:
            for v, prev in zip(n.outputs, seen[k]):
                rename[v.name] = prev
            continue
        seen[k] = [v.name for v in n.outputs]
        kept.append(n)
    g.nodes = kept
    g.outputs = [rename.get(o, o) for o in g.outputs]
    return g
