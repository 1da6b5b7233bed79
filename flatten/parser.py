"""Parse the Flat IR text form (flatten/printer.py writes it) back into a Graph.

Pass tests are written as IR text (MLC-LLM style), so the parser re-infers every output
type through the op registry and rejects a type comment that disagrees, naming the line.
docs/ir-format.md has the grammar.
"""

from __future__ import annotations

import ast
import io
import keyword
import re
import tokenize
from typing import Any

from portlayer.errors import PortlayerError
from portlayer.flatten.ir import Dim, Graph, Node, TensorType, Value, normalize_dim


class ParseError(PortlayerError, ValueError):
    """The IR text is malformed or disagrees with the op registry (the message names the line)."""


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
