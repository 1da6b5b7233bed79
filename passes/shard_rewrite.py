"""shard, part 4: the graph surgery every tensor-parallel rule shares: how a parameter is cut (a
:class:`Rule`), cutting it, inserting the collectives after a sharded op, re-typing the graph."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from portlayer.flatten.ir import Graph, Node, TensorType, Value
from portlayer.flatten.ops import get_op


@dataclass
class Rule:
    """How one parameter is cut: ``index`` rows of ``dim`` (-1 entries: zero padding), or ``rank0``."""

    kind: str
    dim: int = 0
    index: list[int] = field(default_factory=list)


def cut(t: torch.Tensor, r: Rule) -> torch.Tensor:
    """This rank's slice of ``t`` (the whole tensor for ``rank0``; zeros where the index is -1)."""
    if r.kind == "rank0":
        return t
    idx = torch.tensor([max(i, 0) for i in r.index], dtype=torch.long)
    out = t.index_select(r.dim, idx)
    pad = torch.tensor([i < 0 for i in r.index])
    if bool(pad.any()):
        shape = [1] * out.dim()
        shape[r.dim] = len(r.index)
        out = out.masked_fill(pad.reshape(shape), 0)
    return out.contiguous()


def insert_after(g: Graph, after: Mapping[str, list[tuple[str, dict[str, Any]]]]) -> None:
    """Each listed linear writes ``<out>_tp_part``; the collectives (and slice) after it produce the
    original value name, so every consumer reads the combined result unchanged."""
    for name, ops in after.items():
        lin = g.node(name)
        out = lin.outputs[0]
        src = f"{out.name}_tp_part"
        lin.outputs = [Value(src, out.type)]
        chain = []
        for k, (op, attrs) in enumerate(ops):
            last = k == len(ops) - 1
            value = out.name if last else f"{out.name}_tp_{op}"
            chain.append(Node(f"{name}_tp_{op}", op, [src], [Value(value, out.type)], dict(attrs),
                              {"source": lin.meta.get("source", name), "why": f"tensor parallel {op}"}))
            src = value
        i = g.nodes.index(lin)
        g.nodes[i + 1:i + 1] = chain


def reinfer(g: Graph) -> None:
    """Every value's type again, in order, after the cuts changed parameter shapes and attributes."""
    types: dict[str, TensorType] = {v.name: v.type for v in g.inputs}
    types.update(g.params)
    for node in g.nodes:
        d = get_op(node.op)
        attrs = d.complete_attrs(node.attrs)
        ins = [types[i] if i is not None else None for i in node.inputs]
        outs = d.infer(ins, attrs)
        node.outputs = [Value(v.name, t) for v, t in zip(node.outputs, outs)]
        for v in node.outputs:
            types[v.name] = v.type
