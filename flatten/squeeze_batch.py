"""Drop the unit batch axis HF models carry, so the IR is a flat [num_tokens, ...] stream.

Capture wraps a batch-1 HF model, so most values are [1, num_tokens, ...]. This rewrite
walks the graph once and, node by node, re-expresses ops on the squeezed values (axis
attributes shift by one; reshape targets lose their leading 1). Where an op cannot be
re-expressed (it touches axis 0, or mixes squeezed and full-rank operands) the original
rank is restored with a reshape first, so the result is always equivalent.
"""

from __future__ import annotations

from typing import Any

from portlayer.flatten.ir import Graph, Node, TensorType, Value
from portlayer.flatten.ops import get_op

_AXIS_ATTRS = {"softmax": ("dim",), "slice": ("dim",), "concat": ("dim",), "index_select": ("dim",),
               "gather": ("dim",), "l2_normalize": ("dim",), "transpose": ("dim0", "dim1")}
_REDUCTIONS = {"sum", "mean", "amax", "amin"}
_LAST_AXIS = {"linear", "rms_norm", "layer_norm", "embedding", "rope", "cast"}


def _shift(axis: int, rank: int) -> int | None:
    """Axis in the squeezed tensor (rank-1), or None if it is the batch axis."""
    a = axis % rank
    return None if a == 0 else (a - 1 if axis >= 0 else axis)


def squeeze_unit_batch(graph: Graph) -> Graph:
    g = graph.copy()
    types: dict[str, TensorType] = {v.name: v.type for v in g.inputs}
    types.update(g.params)
    squeezed: set[str] = set()
    alias: dict[str, str] = {}
    out_nodes: list[Node] = []

    def restore(v: str, orig: TensorType, at: Node) -> str:
        name = f"{v}_unsq"
        if name not in types:
            t = orig
            out_nodes.append(Node(name, "reshape", [v], [Value(name, t)], {"shape": list(t.shape)}, dict(at.meta)))
            types[name] = t
        return name

    orig_types = graph.value_types()
    for n in g.nodes:
        ins = [alias.get(i, i) if i is not None else None for i in n.inputs]
        sq = [i is not None and i in squeezed for i in n.inputs]
        new_attrs: dict[str, Any] | None = dict(n.attrs)
        if n.op == "reshape" and len(n.outputs) == 1:
            tgt = list(n.attrs["shape"])
            src = types[ins[0]]
            if tgt and tgt[0] == 1 and len(tgt) >= 2 and list(src.shape) == tgt[1:]:
                alias[n.outputs[0].name] = ins[0]
                squeezed.add(n.outputs[0].name)
                continue
            if tgt and tgt[0] == 1 and len(tgt) >= 2:
                new_attrs["shape"] = tgt[1:]
        elif any(sq):
            new_attrs = _adapt(n, ins, sq, types)
        if new_attrs is None:
            ins = [restore(i, orig_types[n.inputs[k]], n) if s else i for k, (i, s) in enumerate(zip(ins, sq))]
            new_attrs = dict(n.attrs)
        try:
            outs = get_op(n.op).infer([types[i] if i is not None else None for i in ins], new_attrs)
        except ValueError:
            ins = [restore(i, orig_types[n.inputs[k]], n) if s else i for k, (i, s) in enumerate(zip(ins, sq))]
            new_attrs = dict(n.attrs)
            outs = get_op(n.op).infer([types[i] if i is not None else None for i in ins], new_attrs)
        new_outputs = []
        for v, t in zip(n.outputs, outs):
            new_outputs.append(Value(v.name, t))
            types[v.name] = t
            if tuple(t.shape) == tuple(v.type.shape):
                continue
            if v.type.rank >= 1 and v.type.shape[0] == 1 and tuple(t.shape) == tuple(v.type.shape[1:]):
                squeezed.add(v.name)
            else:
                raise AssertionError(f"squeeze_unit_batch: {n.name} changed type {v.type} -> {t}")
        out_nodes.append(Node(n.name, n.op, ins, new_outputs, new_attrs, dict(n.meta)))
    outputs = []
    for o in g.outputs:
        o2 = alias.get(o, o)
        if tuple(orig_types[o].shape) != tuple(types[o2].shape):
            o2 = restore(o2, orig_types[o], out_nodes[-1])
        outputs.append(o2)
    g.nodes = out_nodes
    g.outputs = outputs
    return g


def _adapt(n: Node, ins: list[str | None], sq: list[bool], types: dict[str, TensorType]) -> dict[str, Any] | None:
    """Attributes for ``n`` on squeezed inputs, or None when it must see the original rank."""
    kind = get_op(n.op).kind
    if n.op in _LAST_AXIS:
        data = 1 if n.op == "embedding" else 0
        ok = sq[data] and not any(s for k, s in enumerate(sq) if k != data)
        return dict(n.attrs) if ok else None
    full_rank = max(types[i].rank for i, s in zip(ins, sq) if i is not None and s) + 1
    for i, s in zip(ins, sq):
        if i is not None and not s and types[i].rank >= full_rank:
            return None  # a full-rank operand that kept its batch axis
    attrs = dict(n.attrs)
    if n.op in _AXIS_ATTRS:
        for a in _AXIS_ATTRS[n.op]:
            new = _shift(attrs[a], full_rank)
            if new is None:
                return None
            attrs[a] = new
        return attrs
    if n.op in _REDUCTIONS:
        if not attrs["dims"]:
            return None
        dims = [_shift(d, full_rank) for d in attrs["dims"]]
        if any(d is None for d in dims):
            return None
        attrs["dims"] = dims
        return attrs
    if n.op == "permute":
        dims = [d % full_rank for d in attrs["dims"]]
        if dims[0] != 0:
            return None
        attrs["dims"] = [d - 1 for d in dims[1:]]
        return attrs
    if n.op == "expand":
        shape = list(attrs["shape"])
        if shape and shape[0] == 1:
            attrs["shape"] = shape[1:]
            return attrs
        return None
    if kind == "pointwise":
        return attrs
    return None
