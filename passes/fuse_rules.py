"""Fusion legality: may two kernel groups become one kernel? Separate from priority (fuse.py
orders candidates by bytes saved; this module only answers yes or no, with the reason).

A group is a set of node names. Views are free and ride along with whatever they touch.
The generic rules live here: vendor calls and attention are sealed (one opaque call each),
every node must have an implementation that can be generated into a larger kernel (trait
``fusible``), no cycle through outside nodes, at most ``max_fused_inputs`` inputs, and no view
between two compute nodes of the kernel. What the kernel itself can take is not decided here:
the merged group's **anchor** (its GEMM, else rope, else row norm, else its first node) names
the implementation whose lowering will realise the group, and that lowering's ``accepts``
answers (backends/impls_*.py, codegen/kernels/*.py). So every group this pass forms is one a
lowering takes whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from portlayer.backends.impls import find
from portlayer.codegen.lowering import is_view
from portlayer.flatten.ir import Graph, Node, TensorType
from portlayer.flatten.ops import get_op

ROW_NORMS = {"rms_norm", "layer_norm", "softmax", "l2_normalize"}


def kind(n: Node) -> str:
    return get_op(n.op).kind


@dataclass
class FuseState:
    """What legality needs to know about the graph and the current grouping."""

    graph: Graph
    max_inputs: int
    #: rows at or below which the descriptor runs the few-rows GEMM (gemm_rule): a GEMM lowering's
    #: ``accepts`` takes a norm prologue only where that kernel exists
    gemv_rows: int = 0
    gemv_weight_bytes: int = 0  # ... and for weights up to this size (0: any; tuning.gemv_max_weight_mib)
    types: dict[str, TensorType] = field(init=False)
    nodes: dict[str, Node] = field(init=False)
    prod: dict[str, Node] = field(init=False)
    order: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.types = self.graph.value_types()
        self.nodes = {n.name: n for n in self.graph.nodes}
        self.prod = self.graph.producers()
        self.order = {n.name: i for i, n in enumerate(self.graph.nodes)}
        self.users = self.graph.users()
        self.group_of: dict[str, int] = {}
        self.members: dict[int, set[str]] = {}
        self.sealed: dict[int, str] = {}

    def compute(self, gid: int) -> list[Node]:
        return sorted((self.nodes[m] for m in self.members[gid] if not is_view(self.nodes[m])),
                      key=lambda n: self.order[n.name])

    def group_kind(self, gid: int) -> str:
        if gid in self.sealed:
            return "vendor"
        comp = self.compute(gid)
        ops = {n.op for n in comp}
        kinds = {kind(n) for n in comp}
        if not comp:
            return "view"
        if "gemm" in kinds:
            return "gemm"
        if "rope" in ops:
            return "rope"
        if kinds & {"attention", "data", "sequence", "creation"}:
            return comp[0].op if comp[0].op in ("attention", "embedding", "pooling") else "data"
        if ops & ROW_NORMS:
            return "reduction"
        if "reduction" in kinds:
            return "data"
        return "pointwise"

    # ---- the GroupQuery a lowering's ``accepts`` sees (codegen/lowering.py) ----------------
    def producer(self, value: str | None) -> Node | None:
        return self.prod.get(value) if value is not None else None

    def used_outside(self, value: str, members: set[str]) -> bool:
        return value in self.graph.outputs or any(u.name not in members for u in self.users.get(value, []))

    def external_inputs(self, names: set[str]) -> list[str]:
        produced = {v.name for m in names for v in self.nodes[m].outputs}
        seen: list[str] = []
        for m in sorted(names, key=self.order.__getitem__):
            for i in self.nodes[m].inputs:
                if i is not None and i not in produced and i not in seen:
                    seen.append(i)
        return seen


def _impl_fusible(st: FuseState, nodes: list[Node]) -> tuple[bool, str]:
    for n in nodes:
        name = n.meta.get("impl")
        impl = find(name, n.op) if name else None
        if impl is None or not impl.trait("fusible"):
            return False, f"{n.name} runs {name or 'no selected impl'}, a single call that cannot be generated into a larger kernel"
    return True, ""


def _reaches(st: FuseState, src: set[str], dst: set[str], graph_users: Mapping[str, list[Node]]) -> bool:
    """Is there a path src -> (outside both) -> dst? Then merging would create a cycle."""
    both = src | dst
    stack = [u.name for m in src for v in st.nodes[m].outputs for u in graph_users.get(v.name, []) if u.name not in both]
    seen: set[str] = set()
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        for v in st.nodes[x].outputs:
            for u in graph_users.get(v.name, []):
                if u.name in dst:
                    return True
                if u.name not in both:
                    stack.append(u.name)
    return False


def anchor_of(nodes: list[Node]) -> Node:
    """The node whose implementation realises a group: its GEMM, else attention, else rope, else
    row norm, else its first compute node (a pointwise chain)."""
    def rank(n: Node) -> int:
        if kind(n) == "gemm":
            return 0
        if kind(n) == "attention":
            return 1
        if n.op == "rope":
            return 2
        if n.op in ROW_NORMS:
            return 3
        return 4

    return min(nodes, key=lambda n: (rank(n), nodes.index(n)))


def _interior_view(st: FuseState, merged: set[str]) -> str | None:
    """A view whose input comes from the kernel's compute and whose output feeds its compute."""
    for m in merged:
        n = st.nodes[m]
        if not is_view(n):
            continue
        src = st.prod.get(n.inputs[0])
        while src is not None and src.name in merged and is_view(src):
            src = st.prod.get(src.inputs[0])
        if src is None or src.name not in merged:
            continue
        stack, seen = [n.outputs[0].name], set()
        while stack:
            v = stack.pop()
            for u in st.users.get(v, []):
                if u.name in merged and not is_view(u):
                    return n.name
                if u.name in merged and is_view(u) and u.name not in seen:
                    seen.add(u.name)
                    stack.append(u.outputs[0].name)
    return None


def can_fuse(st: FuseState, a: int, b: int, users: Mapping[str, list[Node]]) -> tuple[bool, str]:
    for g in (a, b):
        if g in st.sealed:
            return False, f"{st.sealed[g]} is one vendor call"
    merged = st.members[a] | st.members[b]
    comp = sorted((st.nodes[m] for m in merged if not is_view(st.nodes[m])), key=lambda n: st.order[n.name])
    if not comp:
        return True, ""
    if any(kind(n) in ("attention", "data", "sequence", "creation") for n in comp):
        return False, "attention, data movement and pooling are kernels of their own"
    ok, why = _impl_fusible(st, comp)
    if not ok:
        return ok, why
    if _reaches(st, st.members[a], st.members[b], users) or _reaches(st, st.members[b], st.members[a], users):
        return False, "a node outside both groups sits between them (fusing would form a cycle)"
    # a quantized weight's scales / offsets are read with its integers, tile by tile: one operand, not three
    parts = {n.inputs[j] for n in comp if n.op == "linear_wq" for j in (2, 4) if len(n.inputs) > j and n.inputs[j]}
    ext = [i for i in st.external_inputs(merged) if i not in parts]
    if len(ext) > st.max_inputs:
        return False, f"{len(ext)} inputs exceed max_fused_inputs={st.max_inputs} (plan: registers / shared memory)"
    view = _interior_view(st, merged)
    if view is not None:
        return False, f"view {view} would sit between two compute nodes of one kernel"
    anchor = anchor_of(comp)
    impl = find(anchor.meta.get("impl", ""), anchor.op)
    if impl is None or impl.accepts is None:
        return False, f"{anchor.name} runs {anchor.meta.get('impl')}, which has no lowering to ask"
    ok, why = impl.accepts(st, comp)
    return (True, "") if ok else (False, f"{impl.name}: {why}")
