"""Small graph-rewriting toolkit shared by patterns and passes.

A :class:`Rewriter` works on a copy of a graph: it answers producer/user queries,
inserts new nodes right before a root node (so execution order stays valid) and
redirects every use of an old value to a new one. :func:`dce` then drops what became
dead. :class:`Pat` is a tiny structural matcher with commutative add/mul.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from portlayer.flatten.ir import Graph, GraphBuilder, Node, TensorType

COMMUTATIVE = {"add", "mul", "maximum", "minimum", "eq", "ne", "logical_and", "logical_or"}


class Rewriter:
    def __init__(self, graph: Graph) -> None:
        self.g = graph
        self.b = GraphBuilder(graph)
        self.refresh()

    def refresh(self) -> None:
        self.prod: dict[str, Node] = self.g.producers()
        self.users_map: dict[str, list[Node]] = self.g.users()
        self.index: dict[str, int] = {n.name: i for i, n in enumerate(self.g.nodes)}

    def producer(self, value: str | None) -> Node | None:
        return self.prod.get(value) if value is not None else None

    def users(self, value: str) -> list[Node]:
        return self.users_map.get(value, [])

    def type(self, value: str) -> TensorType:
        return self.b.types[value]

    def is_output(self, value: str) -> bool:
        return value in self.g.outputs

    def insert_before(self, root: Node, build: Callable[[GraphBuilder], str]) -> str:
        """Run ``build`` (which appends nodes through the builder) and move the new nodes
        right before ``root``; returns the value ``build`` returned."""
        start = len(self.g.nodes)
        out = build(self.b)
        new = self.g.nodes[start:]
        del self.g.nodes[start:]
        pos = self.g.nodes.index(root)
        self.g.nodes[pos:pos] = new
        self.refresh()
        return out

    def replace_uses(self, old: str, new: str) -> None:
        """Point every use of ``old`` (and graph outputs) at ``new``."""
        if old == new:
            return
        for n in self.g.nodes:
            if old in n.inputs:
                n.inputs = [new if i == old else i for i in n.inputs]
        self.g.outputs = [new if o == old else o for o in self.g.outputs]
        self.refresh()

    def add_param(self, name: str, tensor: Any) -> str:
        return self.b.add_param(name, tensor)


def dce(graph: Graph) -> Graph:
    """Remove nodes whose outputs are unused, then unused parameters (in place; returns graph)."""
    live = set(graph.outputs)
    kept: list[Node] = []
    for n in reversed(graph.nodes):
        if any(v.name in live for v in n.outputs):
            kept.append(n)
            live.update(i for i in n.inputs if i is not None)
    graph.nodes = list(reversed(kept))
    for p in list(graph.params):
        if p not in live:
            del graph.params[p]
            graph.weights.pop(p, None)
    return graph


@dataclass
class Pat:
    """Structural pattern: op name, argument patterns, optional scalar attribute value.

    Arguments are Pat, Var (binds a value name; a second occurrence must be the same
    value) or None (matches anything). ``scalar`` compares the node's 'scalar' attribute.
    """

    op: str
    args: tuple[Any, ...] = ()
    scalar: float | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    bind: str | None = None


@dataclass(frozen=True)
class Var:
    name: str


def match(rw: Rewriter, pat: Any, value: str | None, env: dict[str, str] | None = None) -> dict[str, str] | None:
    """Match ``pat`` against the producer chain of ``value``; returns the bindings or None."""
    env = dict(env or {})
    if pat is None:
        return env
    if isinstance(pat, Var):
        if value is None:
            return None
        if pat.name in env:
            return env if env[pat.name] == value else None
        env[pat.name] = value
        return env
    node = rw.producer(value)
    if node is None or node.op != pat.op:
        return None
    if pat.scalar is not None:
        s = node.attrs.get("scalar")
        if s is None or not math.isclose(float(s), pat.scalar, rel_tol=1e-4):
            return None
    for k, v in pat.attrs.items():
        if node.attrs.get(k) != v:
            return None
    ins = [i for i in node.inputs if i is not None]
    if len(ins) != len(pat.args):
        return None
    orders = [list(range(len(ins)))]
    if node.op in COMMUTATIVE and len(ins) == 2:
        orders.append([1, 0])
    for order in orders:
        e = dict(env)
        ok = True
        for p, idx in zip(pat.args, order):
            r = match(rw, p, ins[idx], e)
            if r is None:
                ok = False
                break
            e = r
        if ok:
            if pat.bind:
                e[pat.bind] = node.name
            return e
    return None
