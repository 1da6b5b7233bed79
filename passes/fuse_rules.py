"""Fusion legality: may two kernel groups become one kernel? Separate from priority (fuse.py
orders candidates by bytes saved; this module only answers yes or no, with the reason).

A group is a set of node names. Views are free and ride along with whatever they touch.
Kernels that can be generated (impl trait ``fusible``) fuse by these shapes:

- pointwise chains over one iteration shape;
- one row reduction (rms_norm, layer_norm, softmax, l2_normalize) with pointwise prologue
  and epilogue over its row shape (residual add + rms_norm);
- one GEMM whose implementation takes epilogues, plus pointwise epilogue nodes over its
  output shape whose extra tensor operands are parameters (bias, scale) or outputs of other
  GEMMs (the gate of silu(gate) * up). A residual-stream operand is refused: that add fuses
  with the following norm instead, which writes the new residual and the normed row in one
  pass. Nothing is fused into a GEMM's operands (no prologue);
- rope on q and k together (same positions and table), with per-head rms_norm prologues
  (Qwen3's q_norm / k_norm).

Vendor calls and attention are sealed: one opaque call each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from portlayer.backends.impls import find
from portlayer.flatten.ir import Graph, Node, TensorType
from portlayer.flatten.ops import get_op

ROW_NORMS = {"rms_norm", "layer_norm", "softmax", "l2_normalize"}


def kind(n: Node) -> str:
    return get_op(n.op).kind


def is_view(n: Node) -> bool:
    return kind(n) == "view"


@dataclass
class FuseState:
    """What legality needs to know about the graph and the current grouping."""

    graph: Graph
    max_inputs: int
    types: dict[str, TensorType] = field(init=False)
    nodes: dict[str, Node] = field(init=False)
    prod: dict[str, Node] = field(init=False)
    order: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.types = self.graph.value_types()
        self.nodes = {n.name: n for n in self.graph.nodes}
        self.prod = self.graph.producers()
        self.order = {n.name: i for i, n in enumerate(self.graph.nodes)}
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


def can_fuse(st: FuseState, a: int, b: int, users: Mapping[str, list[Node]]) -> tuple[bool, str]:
    for g in (a, b):
        if g in st.sealed:
            return False, f"{st.sealed[g]} is one vendor call"
    merged = st.members[a] | st.members[b]
    comp = sorted((st.nodes[m] for m in merged if not is_view(st.nodes[m])), key=lambda n: st.order[n.name])
    if any(kind(n) in ("attention", "data", "sequence", "creation") for n in comp):
        return False, "attention, data movement and pooling are kernels of their own"
    ok, why = _impl_fusible(st, comp)
    if not ok:
        return ok, why
    if _reaches(st, st.members[a], st.members[b], users) or _reaches(st, st.members[b], st.members[a], users):
        return False, "a node outside both groups sits between them (fusing would form a cycle)"
    ext = st.external_inputs(merged)
    if len(ext) > st.max_inputs:
        return False, f"{len(ext)} inputs exceed max_fused_inputs={st.max_inputs} (plan: registers / shared memory)"
    gemms = [n for n in comp if kind(n) == "gemm"]
    ropes = [n for n in comp if n.op == "rope"]
    norms = [n for n in comp if n.op in ROW_NORMS]
    others = [n for n in comp if kind(n) == "reduction" and n.op not in ROW_NORMS]
    if others:
        return False, f"{others[0].op} is a general reduction; only row norms take prologues and epilogues"
    if gemms:
        return _gemm_rule(st, gemms, comp, merged)
    if ropes:
        return _rope_rule(st, ropes, comp, merged)
    if norms:
        return _norm_rule(st, norms, comp)
    shapes = {tuple(n.outputs[0].type.shape) for n in comp}
    return (True, "") if len(shapes) == 1 else (False, f"pointwise nodes iterate over different shapes {sorted(map(str, shapes))}")


def _gemm_rule(st: FuseState, gemms: list[Node], comp: list[Node], merged: set[str]) -> tuple[bool, str]:
    if len(gemms) > 1:
        return False, "two GEMMs in one kernel"
    g = gemms[0]
    impl = find(g.meta.get("impl", ""), g.op)
    if impl is None or not impl.trait("epilogue"):
        return False, f"{g.meta.get('impl')} takes no epilogue"
    shape = g.outputs[0].type.shape
    produced = {v.name for m in merged for v in st.nodes[m].outputs}
    for n in comp:
        if n is g:
            continue
        if kind(n) != "pointwise":
            return False, f"{n.op} cannot be a GEMM epilogue (pointwise only)"
        if n.outputs[0].type.shape != shape:
            return False, f"epilogue {n.name} does not iterate over the GEMM output {list(shape)}"
        if st.order[n.name] < st.order[g.name] and _feeds(st, n, g, merged):
            return False, f"{n.name} would be a GEMM prologue; the GEMM template reads plain operands"
        for i in n.inputs:
            if i is None or i in produced or i in st.graph.params:
                continue
            p = st.prod.get(i)
            if p is None or kind(p) != "gemm":
                return False, (f"epilogue operand {i} is not a parameter or a GEMM output (a residual stream: "
                               "it fuses with the following norm)")
    return True, ""


def _feeds(st: FuseState, n: Node, target: Node, merged: set[str]) -> bool:
    outs = {v.name for v in n.outputs}
    frontier = [target]
    while frontier:
        t = frontier.pop()
        for i in t.inputs:
            if i in outs:
                return True
            p = st.prod.get(i) if i else None
            if p is not None and p.name in merged:
                frontier.append(p)
    return False


def _rope_rule(st: FuseState, ropes: list[Node], comp: list[Node], merged: set[str]) -> tuple[bool, str]:
    if len(ropes) > 2:
        return False, "more than two ropes (q and k) in one kernel"
    if len(ropes) == 2 and (ropes[0].inputs[1:] != ropes[1].inputs[1:] or ropes[0].attrs != ropes[1].attrs):
        return False, "the two ropes use different positions, tables or attrs"
    for n in comp:
        if n.op == "rope":
            continue
        if n.op != "rms_norm":
            return False, f"the rope kernel takes only per-head rms_norm prologues, not {n.op}"
        if not any(_feeds(st, n, r, merged) for r in ropes):
            return False, f"{n.name} is not a per-head norm feeding the rope"
    return True, ""


def _norm_rule(st: FuseState, norms: list[Node], comp: list[Node]) -> tuple[bool, str]:
    if len(norms) > 1:
        return False, "two row reductions in one kernel"
    r = norms[0]
    shape = r.outputs[0].type.shape
    for n in comp:
        if n is not r and n.outputs[0].type.shape != shape:
            return False, f"{n.name} does not iterate over the normalised rows {list(shape)}"
    return True, ""
