"""Helpers several passes share: re-inferring types, constants, byte sizes of values."""

from __future__ import annotations

from collections.abc import Mapping

from portlayer.flatten.ir import Graph, TensorType
from portlayer.flatten.ops import get_op

SIDE_EFFECT_KINDS = ("attention",)  # writes the paged KV cache


def retype(graph: Graph) -> Graph:
    """Re-infer every node's output types in order (after params changed dtype); in place."""
    types: dict[str, TensorType] = {v.name: v.type for v in graph.inputs}
    types.update(graph.params)
    for n in graph.nodes:
        ins = [types[i] if i is not None else None for i in n.inputs]
        try:
            outs = get_op(n.op).infer(ins, n.attrs)
        except Exception as e:
            raise ValueError(f"node {n.name} ({n.op}, from {n.meta.get('source', '?')}): type inference failed "
                             f"after a pass changed its inputs: {e}") from e
        n.outputs = [v.__class__(v.name, t) for v, t in zip(n.outputs, outs)]
        for v in n.outputs:
            types[v.name] = v.type
    return graph


def has_side_effects(op: str) -> bool:
    return get_op(op).kind in SIDE_EFFECT_KINDS


def value_bytes(t: TensorType, bindings: Mapping[str, int]) -> int:
    return t.nbytes(dict(bindings))


def fresh_name(taken: set[str], base: str) -> str:
    base = "".join(c if (c.isalnum() or c == "_") else "_" for c in base)
    if base not in taken:
        taken.add(base)
        return base
    k = 1
    while f"{base}_{k}" in taken:
        k += 1
    taken.add(f"{base}_{k}")
    return f"{base}_{k}"


def all_names(graph: Graph) -> set[str]:
    return set(graph.value_types()) | {n.name for n in graph.nodes}
