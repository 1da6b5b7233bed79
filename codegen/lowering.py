"""What a lowering sees and returns: one kernel group of the fuse pass, resolved against the graph.

The fuse pass writes ``graph.meta["kernels"]`` (docs/contracts.md); each record names the
implementation of its anchor node. Codegen resolves a record into a :class:`KernelGroup`
and calls that implementation's lowering (backends/impls.py), which returns a
:class:`GroupCode`. Views (reshapes) in a group are not the lowering's business: they are
host-side aliases, emitted before the kernel when they reshape an input and after it when
they reshape an output, so every lowering sees only the compute nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from portlayer.codegen.spec import KernelSpec
from portlayer.flatten.ir import Graph, Node, TensorType
from portlayer.flatten.ops import get_op


class Unlowerable(RuntimeError):
    """A group reached a lowering that cannot take it: a bug in that lowering's ``accepts``."""


class GroupQuery(Protocol):
    """What ``accepts`` may ask about the graph while the fuse pass grows a group."""

    types: Mapping[str, TensorType]
    graph: Graph

    def producer(self, value: str | None) -> Node | None: ...

    def used_outside(self, value: str, members: set[str]) -> bool: ...


@dataclass
class GroupCode:
    """A group's realisation: kernels to define, host statements, values the statements write
    into planned memory (each must have a buffer in the memory plan), and weights the program concatenates
    when it loads (each part then a row-slice view of the concatenation)."""

    kernels: list[KernelSpec] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)
    merged: dict[str, list[str]] = field(default_factory=dict)  # weights concatenated at load: name -> parts


@dataclass
class KernelGroup:
    """One fuse-pass group: ``nodes`` are its compute nodes in order; ``outputs`` the compute
    values that leave the kernel (read by later groups, by the group's trailing views, or graph
    outputs); ``inputs`` what the kernel reads from outside (after leading views)."""

    name: str
    impl: str
    family: str
    anchor: str
    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    pre_views: list[Node] = field(default_factory=list)
    post_views: list[Node] = field(default_factory=list)
    scratch: list[str] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]


def is_view(n: Node) -> bool:
    return get_op(n.op).kind == "view"


def resolve_group(graph: Graph, record: Mapping[str, Any], nodes: Mapping[str, Node],
                  users: Mapping[str, list[Node]]) -> KernelGroup:
    """A kernel record -> KernelGroup, splitting its views into leading and trailing aliases."""
    members = [nodes[n] for n in record["nodes"]]
    names = {n.name for n in members}
    compute = [n for n in members if not is_view(n)]
    made_by_compute = {v.name for n in compute for v in n.outputs}
    pre, post = [], []
    from_compute: set[str] = set(made_by_compute)
    for n in members:
        if not is_view(n):
            continue
        if n.inputs[0] in from_compute:
            post.append(n)
            from_compute.add(n.outputs[0].name)
        else:
            pre.append(n)
    for v in post:
        if any(u.name in names and not is_view(u) for u in users.get(v.outputs[0].name, [])):
            raise Unlowerable(f"group {record['name']}: view {v.name} sits between two compute nodes of the kernel")
    post_inputs = {v.inputs[0] for v in post}
    outputs = []
    for n in compute:
        for v in n.outputs:
            outside = any(u.name not in names for u in users.get(v.name, [])) or v.name in graph.outputs
            if (outside or v.name in post_inputs) and v.name not in outputs:
                outputs.append(v.name)
    inputs: list[str] = []
    for n in compute:
        for i in n.inputs:
            if i is not None and i not in made_by_compute and i not in inputs:
                inputs.append(i)
    return KernelGroup(record["name"], record.get("impl", "reference"), record.get("family", "torch"),
                       record.get("anchor") or (compute[0].name if compute else members[0].name), compute, inputs,
                       outputs, pre, post, list(record.get("scratch", [])), dict(record))
