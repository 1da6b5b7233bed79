"""Constant folding and algebraic clean-ups (rope tables, shape arithmetic, splats).

- A node whose inputs are all parameters (or that creates a static tensor) is evaluated once
  and becomes a parameter: transposed or scaled weights, rope cos/sin tables computed from a
  static ``arange`` (capture already precomputes the usual cache; this catches the rest).
- ``embedding(W, full(c))`` is the one row ``W[c]`` for every token (BERT's token-type
  embedding): it becomes a ``[H]`` parameter that the consumer broadcasts.
- A binary op whose operand is a ``full`` splat takes it as a scalar attribute; one whose
  operand is an ``expand`` reads the unexpanded value (broadcasting does the rest).
- Identities go: reshape/expand to the same shape, cast to the same dtype, +0, *1, full slices;
  view chains collapse (``fold_view_chains``).

Folding only happens where weights are loaded (IR parsed from text has none), and never
materialises a constant much larger than its inputs (expanding a weight stays a view).
"""

from __future__ import annotations

import torch

from portlayer.flatten.interpret import ExecContext
from portlayer.flatten.ir import Graph, Node, TensorType, dtype_name
from portlayer.flatten.ops import broadcast_shapes, get_op
from portlayer.flatten.patterns import fold_view_chains
from portlayer.passes.context import PassContext
from portlayer.passes.dce import dce
from portlayer.passes.util import all_names, fresh_name

BINARY = {"add", "sub", "mul", "div", "pow", "maximum", "minimum"}
NO_FOLD_KINDS = {"attention", "sequence"}
MAX_CREATED = 1 << 22


class _Folder:
    def __init__(self, g: Graph) -> None:
        self.g = g
        self.names = all_names(g)
        self.alias: dict[str, str] = {}
        self.changed = False

    def types(self) -> dict[str, TensorType]:
        return self.g.value_types()

    def add_param(self, base: str, t: torch.Tensor) -> str:
        name = fresh_name(self.names, base)
        t = t.detach().contiguous()
        self.g.params[name] = TensorType(dtype_name(t.dtype), tuple(t.shape))
        self.g.weights[name] = t
        return name

    def run(self) -> None:
        prod = {v.name: n for n in self.g.nodes for v in n.outputs}
        kept: list[Node] = []
        for n in self.g.nodes:
            n.inputs = [self.alias.get(i, i) if i is not None else None for i in n.inputs]
            out = self.fold_node(n, prod)
            if out is None:
                kept.append(n)
            elif isinstance(out, str):
                self.alias[n.outputs[0].name] = out
                self.changed = True
            else:
                kept.extend(out)
                for m in out:
                    for v in m.outputs:
                        prod[v.name] = m
                self.changed = True
        self.g.nodes = kept
        self.g.outputs = [self.alias.get(o, o) for o in self.g.outputs]

    # ---- rules -------------------------------------------------------------------------------------
    def fold_node(self, n: Node, prod: dict[str, Node]) -> str | list[Node] | None:
        d = get_op(n.op)
        if len(n.outputs) == 1:
            ident = self.identity(n, d.kind)
            if ident is not None:
                return ident
            const = self.constant(n, d.kind)
            if const is not None:
                return const
        if n.op == "embedding":
            return self.embedding_of_splat(n, prod)
        if n.op in BINARY or n.op in ("eq", "ne", "lt", "le", "gt", "ge"):
            return self.splat_operand(n, prod)
        return None

    def identity(self, n: Node, kind: str) -> str | None:
        x = n.inputs[0] if n.inputs else None
        if x is None:
            return None
        tx, to = self.types()[x], n.outputs[0].type
        if tx != to:
            return None
        if kind == "view" and n.op in ("reshape", "expand", "slice") and (n.op != "slice" or n.attrs.get("step", 1) == 1):
            return x
        if n.op == "cast":
            return x
        s = n.attrs.get("scalar")
        single = len(n.inputs) < 2 or n.inputs[1] is None
        if single and s is not None and not n.attrs.get("reverse"):
            if (n.op in ("add", "sub") and s == 0) or (n.op in ("mul", "div", "pow") and s == 1):
                return x
        return None

    def constant(self, n: Node, kind: str) -> list[Node] | None:
        if kind in NO_FOLD_KINDS or n.op == "full" and not n.outputs[0].type.is_static:
            return None
        ins = [i for i in n.inputs if i is not None]
        if any(i not in self.g.params or i not in self.g.weights for i in ins):
            return None
        if not ins and kind != "creation":
            return None
        out_t = n.outputs[0].type
        if not out_t.is_static:
            return None
        in_numel = sum(self.g.params[i].numel() for i in ins)
        if out_t.numel() > max(2 * in_numel + 4096, 0 if ins else MAX_CREATED):
            return None
        args = [self.g.weights[i] if i is not None else None for i in n.inputs]
        value = get_op(n.op).reference(args, n.attrs, ExecContext())[0]
        return self.as_param_node(n, value)

    def as_param_node(self, n: Node, value: torch.Tensor) -> list[Node]:
        name = self.add_param(f"{n.name}_const", value)
        self.alias[n.outputs[0].name] = name
        return []

    def embedding_of_splat(self, n: Node, prod: dict[str, Node]) -> list[Node] | None:
        w, ids = n.inputs[0], n.inputs[1]
        src = prod.get(ids)
        if src is None or src.op != "full" or w not in self.g.weights:
            return None
        row = self.g.weights[w][int(src.attrs["value"])]
        p = self.add_param(f"{n.name}_row", row)
        out = n.outputs[0]
        return [Node(n.name, "expand", [p], [out], {"shape": list(out.type.shape)}, dict(n.meta))]

    def splat_operand(self, n: Node, prod: dict[str, Node]) -> list[Node] | None:
        if len(n.inputs) < 2 or n.inputs[1] is None:
            return None
        types, out = self.types(), n.outputs[0].type
        for k in (0, 1):
            other, p = n.inputs[1 - k], prod.get(n.inputs[k])
            if p is None:
                continue
            if p.op == "full" and types[other].shape == out.shape and types[other].dtype == out.dtype:
                attrs = dict(n.attrs, scalar=p.attrs["value"], reverse=(k == 0))
                return [Node(n.name, n.op, [other, None], n.outputs, attrs, dict(n.meta))]
            if p.op == "expand":
                src = p.inputs[0]
                ins = list(n.inputs)
                ins[k] = src
                shapes = [types[i].shape for i in ins]
                try:
                    same = broadcast_shapes(*shapes) == out.shape and types[src].dtype == types[n.inputs[k]].dtype
                except ValueError:
                    same = False
                if same:
                    return [Node(n.name, n.op, ins, n.outputs, dict(n.attrs), dict(n.meta))]
        return None


def fold(graph: Graph, ctx: PassContext | None = None) -> Graph:
    g = graph.copy()
    for _ in range(8):
        f = _Folder(g)
        f.run()
        g = dce(f.g)
        if not f.changed:
            break
    return dce(fold_view_chains(g))
