"""The Flat IR as readable Python text (flatten/parser.py reads it back; re-exported here).

The printout is what people read (like torch.fx's generated code or a Thunder trace) and
what pass tests are written in (MLC-LLM style before/after IR text), so it has to be
both pleasant and unambiguous: inputs and params carry their types, attributes are
Python literals, and each node's output types sit in a trailing comment. See
docs/ir-format.md for the grammar.

    def forward(input_ids: int64[num_tokens]):
        # params:
        #   embed_weight: float32[128, 64]
        embed = embedding(embed_weight, input_ids)  # float32[num_tokens, 64]
        norm = rms_norm(embed, None, eps=1e-05)  # float32[num_tokens, 64]
        return norm
"""

from __future__ import annotations

import math
from typing import Any

from portlayer.flatten.ir import Graph, Node
from portlayer.flatten.parser import ParseError, parse_graph, parse_literal, parse_type, split_top_level

__all__ = [
    "ParseError", "canonical_text", "format_literal", "format_node", "parse_graph", "parse_literal", "parse_type",
    "print_graph", "split_top_level",
]

INDENT = "    "
MAX_HEADER = 110


# ---- printing --------------------------------------------------------------------------


def format_literal(v: Any) -> str:
    """A Python literal that ``parse_literal`` reads back; tuples print as lists (JSON has no tuple)."""
    if isinstance(v, float):
        if math.isnan(v):
            return "float('nan')"
        if math.isinf(v):
            return "float('inf')" if v > 0 else "float('-inf')"
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(format_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{format_literal(k)}: {format_literal(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _same_literal(a: Any, b: Any) -> bool:
    """Equality that tells 1 from 1.0 and True from 1, so a printed attr reads back the same."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_literal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_literal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _node_attrs(node: Node) -> list[tuple[str, Any]]:
    """Non-default attrs in the op's declared order (unknown attrs last, kept so verify can flag them)."""
    from portlayer.flatten.ops import all_ops

    opdef = all_ops().get(node.op)
    if opdef is None:
        return list(node.attrs.items())
    out = [(k, node.attrs[k]) for k in opdef.attrs if k in node.attrs and not _same_literal(node.attrs[k], opdef.attrs[k])]
    out += [(k, v) for k, v in node.attrs.items() if k not in opdef.attrs]
    return out


def format_node(node: Node, *, show_meta: bool = False) -> str:
    """One node as ``out = op(args, attr=value)  # type`` (no indentation)."""
    args = ["None" if i is None else i for i in node.inputs]
    args += [f"{k}={format_literal(v)}" for k, v in _node_attrs(node)]
    call = f"{node.op}({', '.join(args)})"
    code = f"{', '.join(v.name for v in node.outputs)} = {call}" if node.outputs else call
    notes = [", ".join(str(v.type) for v in node.outputs)] if node.outputs else []
    if not node.outputs or node.name != node.outputs[0].name:
        notes.append(f"node={node.name}")
    if show_meta and node.meta:
        notes.append(f"meta={format_literal(node.meta)}")
    return f"{code}  # {'  '.join(notes)}" if notes else code


def print_graph(graph: Graph, *, show_meta: bool = False) -> str:
    """The graph as Python-like text; ``show_meta`` adds graph and node meta as comments.

    ``parse_graph`` reads the result back, and printing that again gives the same text.
    """
    lines: list[str] = []
    if show_meta and graph.meta:
        lines.append(f"# meta: {format_literal(graph.meta)}")
    sig = [f"{v.name}: {v.type}" for v in graph.inputs]
    header = f"def forward({', '.join(sig)}):"
    if len(header) <= MAX_HEADER:
        lines.append(header)
    else:
        lines.append("def forward(")
        lines += [f"{INDENT}{s}," for s in sig]
        lines.append("):")
    if graph.params:
        lines.append(f"{INDENT}# params:")
        lines += [f"{INDENT}#   {name}: {t}" for name, t in graph.params.items()]
    lines += [INDENT + format_node(n, show_meta=show_meta) for n in graph.nodes]
    if len(graph.outputs) == 1:
        ret = graph.outputs[0]
    elif graph.outputs:
        ret = ", ".join(graph.outputs)
    else:
        ret = "()"
    lines.append(f"{INDENT}return {ret}")
    return "\n".join(lines) + "\n"


def canonical_text(text: str, *, show_meta: bool = False) -> str:
    """Hand-written IR text in printer form, for before/after pass tests:
    ``assert print_graph(my_pass(parse_graph(BEFORE))) == canonical_text(AFTER)``."""
    return print_graph(parse_graph(text), show_meta=show_meta)
