"""The Flat IR as readable Python text, and the parser that reads that text back.

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

import ast
import io
import keyword
import math
import re
import tokenize
from typing import Any

from portlayer.flatten.ir import Dim, Graph, Node, TensorType, Value, normalize_dim

INDENT = "    "
MAX_HEADER = 110


class ParseError(ValueError):
    """The IR text is malformed or disagrees with the op registry (the message names the line)."""


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


# ---- parsing ---------------------------------------------------------------------------

_TYPE_RE = re.compile(r"^\s*([A-Za-z_]\w*)\[(.*)\]\s*$")
_PARAM_RE = re.compile(r"^#\s+([A-Za-z_]\w*)\s*:\s*(.+)$")
_NOTE_RE = re.compile(r"^(?P<types>.*?)\s*(?:\bnode=(?P<node>[A-Za-z_]\w*))?\s*(?:\bmeta=(?P<meta>\{.*\}))?\s*$")


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside brackets, so ``Max(1, n)`` and ``f32[a, b]`` stay whole."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()] if any(p.strip() for p in parts) else []


def parse_type(text: str) -> TensorType:
    """``float32[num_tokens, 64]`` -> TensorType; ``float32[]`` is a scalar."""
    m = _TYPE_RE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a type like float32[num_tokens, 64]")
    dims: list[Dim] = []
    for d in split_top_level(m.group(2)):
        dims.append(int(d) if re.fullmatch(r"-?\d+", d) else normalize_dim(d))
    return TensorType(m.group(1), tuple(dims))


class _FloatSpecials(ast.NodeTransformer):
    """Turns ``float('inf')`` / ``float('-inf')`` / ``float('nan')`` into constants for literal_eval."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if (
            isinstance(node.func, ast.Name)
            and node.func.id == "float"
            and len(node.args) == 1
            and not node.keywords
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in ("inf", "-inf", "nan")
        ):
            return ast.copy_location(ast.Constant(float(node.args[0].value)), node)
        return node


def _literal_from_ast(node: ast.AST) -> Any:
    return ast.literal_eval(_FloatSpecials().visit(node))


def parse_literal(text: str) -> Any:
    """Inverse of ``format_literal``: Python literals plus float('inf'/'-inf'/'nan')."""
    return _literal_from_ast(ast.parse(text.strip(), mode="eval").body)


def _split_comment(line: str) -> tuple[str, str | None]:
    """Code and trailing comment, found with tokenize so a '#' inside a string attr stays code."""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(line).readline):
            if tok.type == tokenize.COMMENT:
                return line[: tok.start[1]].rstrip(), tok.string[1:].strip()
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return line.rstrip(), None


class _Parser:
    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()
        self.i = 0
        self.graph = Graph()
        self.types: dict[str, TensorType] = {}

    def fail(self, msg: str, lineno: int | None = None) -> ParseError:
        n = self.i if lineno is None else lineno
        src = self.lines[n].strip() if 0 <= n < len(self.lines) else "<end of text>"
        return ParseError(f"line {n + 1}: {msg}\n    {src}")

    def _skip_blank(self) -> None:
        while self.i < len(self.lines) and not self.lines[self.i].strip():
            self.i += 1

    def parse(self) -> Graph:
        self._preamble()
        self._header()
        self._params()
        self._body()
        return self.graph

    def _preamble(self) -> None:
        while self.i < len(self.lines):
            s = self.lines[self.i].strip()
            if s.startswith("def "):
                return
            if s.startswith("# meta:"):
                try:
                    self.graph.meta = dict(parse_literal(s[len("# meta:"):]))
                except (ValueError, SyntaxError, TypeError) as e:
                    raise self.fail(f"graph meta is not a Python dict literal ({e})") from None
            elif s and not s.startswith("#"):
                raise self.fail("expected 'def forward(...):' before any node")
            self.i += 1
        raise self.fail("no 'def forward(...):' header found")

    def _header(self) -> None:
        start = self.i
        text = self.lines[self.i].strip()
        while not text.endswith("):"):
            self.i += 1
            if self.i >= len(self.lines):
                raise self.fail("the 'def forward(' header never closes with '):'", start)
            text += " " + self.lines[self.i].strip()
        self.i += 1
        m = re.fullmatch(r"def\s+forward\s*\((.*)\)\s*:", text)
        if not m:
            raise self.fail("expected 'def forward(name: dtype[dims], ...):'", start)
        for arg in split_top_level(m.group(1)):
            name, _, t = arg.partition(":")
            name = name.strip()
            if not name.isidentifier() or not t.strip():
                raise self.fail(f"input {arg!r} must be 'name: dtype[dims]'", start)
            try:
                typ = parse_type(t.strip())
            except ValueError as e:
                raise self.fail(f"input {name}: {e}", start) from None
            self._define(name, typ, start)
            self.graph.inputs.append(Value(name, typ))

    def _params(self) -> None:
        self._skip_blank()
        if self.i >= len(self.lines) or self.lines[self.i].strip() != "# params:":
            return
        self.i += 1
        while self.i < len(self.lines):
            m = _PARAM_RE.match(self.lines[self.i].strip())
            if not m:
                return
            try:
                typ = parse_type(m.group(2))
            except ValueError as e:
                raise self.fail(f"param {m.group(1)}: {e}") from None
            self._define(m.group(1), typ, self.i)
            self.graph.params[m.group(1)] = typ
            self.i += 1

    def _define(self, name: str, typ: TensorType, lineno: int) -> None:
        if keyword.iskeyword(name):
            raise self.fail(f"{name!r} is a Python keyword and cannot name a value", lineno)
        if name in self.types:
            raise self.fail(f"value {name!r} is defined twice (single assignment)", lineno)
        self.types[name] = typ

    def _body(self) -> None:
        while self.i < len(self.lines):
            raw = self.lines[self.i]
            s = raw.strip()
            if not s or s.startswith("#"):
                self.i += 1
                continue
            if s.startswith("return"):
                self._return(s)
                self.i += 1
                rest = [ln for ln in self.lines[self.i:] if ln.strip() and not ln.strip().startswith("#")]
                if rest:
                    self.i += self.lines[self.i:].index(rest[0])
                    raise self.fail("text after 'return'")
                return
            self.graph.nodes.append(self._node(s))
            self.i += 1
        raise self.fail("the body has no 'return' line")

    def _return(self, s: str) -> None:
        try:
            expr = ast.parse(s[len("return"):].strip() or "()", mode="eval").body
        except SyntaxError as e:
            raise self.fail(f"bad return ({e.msg})") from None
        elts = expr.elts if isinstance(expr, ast.Tuple) else [expr]
        names = []
        for e in elts:
            if not isinstance(e, ast.Name):
                raise self.fail("return takes value names only")
            if e.id not in self.types:
                raise self.fail(f"returned value {e.id!r} is not defined")
            names.append(e.id)
        self.graph.outputs = names

    def _node(self, s: str) -> Node:
        from portlayer.flatten.ops import all_ops

        code, note = _split_comment(s)
        try:
            stmt = ast.parse(code).body
        except SyntaxError as e:
            raise self.fail(f"not a node line 'out = op(args, attr=value)' ({e.msg})") from None
        if len(stmt) != 1:
            raise self.fail("one node per line")
        st = stmt[0]
        if isinstance(st, ast.Assign) and len(st.targets) == 1:
            tgt = st.targets[0]
            tgts = tgt.elts if isinstance(tgt, ast.Tuple) else [tgt]
            if not all(isinstance(t, ast.Name) for t in tgts):
                raise self.fail("assignment targets must be plain names")
            out_names, call = [t.id for t in tgts], st.value
        elif isinstance(st, ast.Expr):
            out_names, call = [], st.value
        else:
            raise self.fail("not a node line 'out = op(args, attr=value)'")
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
            raise self.fail("the right-hand side must be a call of a registry op, op(args, attr=value)")
        op_name = call.func.id
        opdef = all_ops().get(op_name)
        if opdef is None:
            raise self.fail(f"op {op_name!r} is not in the portable op registry (flatten/op_defs/)")
        inputs: list[str | None] = []
        for a in call.args:
            if isinstance(a, ast.Constant) and a.value is None:
                inputs.append(None)
            elif isinstance(a, ast.Name):
                if a.id not in self.types:
                    raise self.fail(f"input {a.id!r} of {op_name} is not defined on an earlier line")
                inputs.append(a.id)
            else:
                raise self.fail(f"inputs of {op_name} must be value names or None; attributes go as name=value")
        attrs: dict[str, Any] = {}
        for kw in call.keywords:
            if kw.arg is None:
                raise self.fail("'**' is not allowed in a node line")
            try:
                attrs[kw.arg] = _literal_from_ast(kw.value)
            except (ValueError, SyntaxError, TypeError):
                raise self.fail(f"attribute {kw.arg} of {op_name} must be a Python literal") from None
        try:
            attrs = opdef.complete_attrs(attrs)
            in_types = [self.types[i] if i is not None else None for i in inputs]
            inferred = opdef.infer(in_types, attrs)
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise self.fail(f"{op_name}: {e}") from None
        declared, node_name, meta = self._note(note)
        if len(out_names) != len(inferred):
            raise self.fail(f"{op_name} produces {len(inferred)} outputs but the line names {len(out_names)}")
        if declared is not None and declared != inferred:
            raise self.fail(
                f"the comment says {', '.join(map(str, declared))} but {op_name} infers "
                f"{', '.join(map(str, inferred))}; fix the comment or the inputs/attrs"
            )
        outs = [Value(n, t) for n, t in zip(out_names, inferred)]
        for v in outs:
            self._define(v.name, v.type, self.i)
        name = node_name or (out_names[0] if out_names else None)
        if name is None:
            raise self.fail("a node without outputs needs 'node=NAME' in its comment")
        return Node(name, op_name, inputs, outs, attrs, meta)

    def _note(self, note: str | None) -> tuple[list[TensorType] | None, str | None, dict[str, Any]]:
        if note is None:
            return None, None, {}
        m = _NOTE_RE.match(note)
        meta: dict[str, Any] = {}
        if m.group("meta"):
            try:
                meta = dict(parse_literal(m.group("meta")))
            except (ValueError, SyntaxError, TypeError):
                raise self.fail("meta= in the comment must be a Python dict literal") from None
        declared = None
        if m.group("types").strip():
            try:
                declared = [parse_type(t) for t in split_top_level(m.group("types"))]
            except ValueError as e:
                raise self.fail(f"the trailing comment must hold the output types: {e}") from None
        return declared, m.group("node"), meta


def parse_graph(text: str) -> Graph:
    """Read ``print_graph`` text back into a Graph (params get types only, weights stay empty).

    Output types are re-inferred through the op registry; a type comment that disagrees
    raises ParseError naming the line. Type comments may be left out in hand-written text.
    """
    return _Parser(text).parse()


def canonical_text(text: str, *, show_meta: bool = False) -> str:
    """Hand-written IR text in printer form, for before/after pass tests:
    ``assert print_graph(my_pass(parse_graph(BEFORE))) == canonical_text(AFTER)``."""
    return print_graph(parse_graph(text), show_meta=show_meta)
