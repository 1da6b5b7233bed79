"""Kernel groups for codegen: the fuse pass's ``graph.meta["kernels"]``, or a default grouping.

The default grouping exists so codegen works (and is tested) before and without the fuse
pass; it follows docs/contracts.md exactly: an ordered list of {name, family, impl, nodes,
inputs, outputs}. It fuses chains of pointwise ops, a residual add into the rms_norm that
follows it, and the q and k rotary embeddings of one attention into one launch.
"""

from __future__ import annotations

from typing import Any

from portlayer.codegen.expr import POINTWISE_OPS
from portlayer.flatten.ir import Graph, Node
from portlayer.flatten.ops import get_op

FAMILY_BY_OP = {
    "embedding": "embedding", "linear": "gemm", "attention": "attention", "rope": "rope",
    "rms_norm": "reduction", "layer_norm": "reduction", "softmax": "reduction", "pooling": "pooling",
}  # fmt: skip


def kernel_groups(graph: Graph) -> list[dict[str, Any]]:
    """The fuse pass's groups when present, else :func:`default_groups`."""
    groups = graph.meta.get("kernels")
    return [dict(g) for g in groups] if groups else default_groups(graph)


def _family(n: Node) -> str:
    if n.op in FAMILY_BY_OP:
        return FAMILY_BY_OP[n.op]
    kind = get_op(n.op).kind
    if kind == "view":
        return "view"
    if n.op in POINTWISE_OPS:
        return "pointwise"
    return "torch"  # realised by the op's reference implementation


def _joins(open_group: list[Node], fam: str, n: Node) -> bool:
    made = {v.name for m in open_group for v in m.outputs}
    first = open_group[0]
    if fam == "pointwise" and _family(first) == "pointwise":
        return any(i in made for i in n.inputs)
    if fam == "rope" and _family(first) == "rope" and len(open_group) == 1:
        same = n.inputs[1:] == first.inputs[1:] and n.attrs == first.attrs
        return same and first.outputs[0].name not in n.inputs
    return False


def default_groups(graph: Graph) -> list[dict[str, Any]]:
    """Greedy grouping in node order; a group runs where its last node was."""
    ordered: list[list[Node]] = []
    open_group: list[Node] = []

    def close() -> None:
        nonlocal open_group
        if open_group:
            ordered.append(open_group)
            open_group = []

    for n in graph.nodes:
        fam = _family(n)
        if open_group and _joins(open_group, fam, n):
            open_group.append(n)
            continue
        made = {v.name for m in open_group for v in m.outputs}
        consumes = any(i in made for i in n.inputs)
        if fam == "reduction" and n.op == "rms_norm" and len(open_group) == 1 and open_group[0].op == "add" \
                and n.inputs[0] == open_group[0].outputs[0].name and len(open_group[0].inputs) == 2 \
                and open_group[0].inputs[1] is not None:
            open_group.append(n)  # residual add + rms_norm in one pass over the row
            close()
            continue
        if consumes:
            close()
        if fam in ("pointwise", "rope"):
            close()
            open_group = [n]
        else:
            ordered.append([n])
    close()
    return [_describe(graph, nodes, i) for i, nodes in enumerate(ordered)]


def _describe(graph: Graph, nodes: list[Node], index: int) -> dict[str, Any]:
    fams = {_family(n) for n in nodes}
    fam = "reduction" if "reduction" in fams else fams.pop() if len(fams) == 1 else "pointwise"
    return group_record(graph, [n.name for n in nodes], fam, name=nodes[-1].name)


def group_record(graph: Graph, node_names: list[str], family: str, name: str | None = None,
                 epilogue: list[str] | None = None) -> dict[str, Any]:
    """A contract-shaped group for ``node_names`` (also handy for hand-built groups in tests)."""
    names = set(node_names)
    nodes = [n for n in graph.nodes if n.name in names]
    made = {v.name for n in nodes for v in n.outputs}
    inputs: list[str] = []
    for n in nodes:
        for i in n.inputs:
            if i is not None and i not in made and i not in inputs:
                inputs.append(i)
    used_outside = {i for n in graph.nodes if n.name not in names for i in n.inputs if i is not None}
    outputs = [v for n in nodes for v in (o.name for o in n.outputs) if v in used_outside or v in graph.outputs]
    rec: dict[str, Any] = {"name": name or nodes[-1].name, "family": family,
                           "impl": f"triton_{family}" if family not in ("view", "torch") else family,
                           "nodes": [n.name for n in nodes], "inputs": inputs, "outputs": outputs}
    if epilogue:
        rec["epilogue"] = list(epilogue)
    return rec
