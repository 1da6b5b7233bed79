"""Symbolic dimensions: one strict grammar, read without evaluating anything.

A dim string comes from files (graph.json, IR text, cached captures, artifacts), so it is
untrusted: ``sympy.sympify`` would run Python in it. Here a small recursive-descent parser
reads the grammar below into a tree, and the tree is built into sympy objects directly
(Symbol/Integer/Add/Mul/floor ...) or evaluated with exact integer arithmetic; nothing in
the text is ever executed. Everything that reads a shape goes through ``parse_dim``.

    expr  := term (('+' | '-') term)*
    term  := unary (('*' | '/' | '//' | '%') unary)*
    unary := ('-' | '+') unary | power
    power := atom ('**' ['-'] INT)?      # exponent <= 16, powers nest <= 3 deep (no 9**9**9 bombs)
    atom  := INT | NAME | FUNC '(' expr (',' expr)* ')' | '(' expr ')'
    FUNC  := ceiling | floor | Max | Min | Mod | PythonMod
           | FloorDiv | CeilToInt | FloorToInt | IntTrueDiv | ModularIndexing   (torch's names)

``/`` is exact (rational) division, ``//`` is floor division, ``%`` is Python's modulo:
the spellings sympy and torch.export print for sizes. Canonical strings are sympy's
spelling of the fully expanded expression over positive-integer symbols, cached per
string: identical layers ask for identical dims, so a deep model costs what one layer does.
"""

from __future__ import annotations

import functools
import keyword
import math
import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from portlayer.errors import PortlayerError

MAX_LENGTH = 1000
MAX_DEPTH = 64
MAX_POWER_NESTING = 3
MAX_EXPONENT = 16
MAX_INT_DIGITS = 40
FUNCTIONS = {"ceiling": (1, 1), "floor": (1, 1), "Max": (2, 64), "Min": (2, 64), "Mod": (2, 2), "PythonMod": (2, 2),
             # torch.utils._sympy spellings torch.export may print for a size; read as the sympy functions
             "FloorDiv": (2, 2), "CeilToInt": (1, 1), "FloorToInt": (1, 1), "IntTrueDiv": (2, 2),
             "ModularIndexing": (3, 3)}
GRAMMAR = ("integers, symbols (identifiers such as num_tokens), + - * / // % **, parentheses and "
           + "/".join(FUNCTIONS) + "(...)")

_TOKEN = re.compile(r"(?:(?P<int>\d+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>//|\*\*|[-+*/%(),]))", re.ASCII)

Tree = tuple  # ("int", n) | ("sym", name) | (op, a, b) | ("neg", a) | ("pow", a, n) | ("call", f, args)


class DimError(PortlayerError, ValueError):
    """A dimension string is not in the dim grammar, or cannot be evaluated (the message names it)."""


def _fail(text: str, why: str) -> DimError:
    return DimError(f"dimension {text!r} is not a symbolic size: {why}. A dim holds {GRAMMAR}")


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    out, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        if i == len(text):
            return out
        m = _TOKEN.match(text, i)
        if m is None:
            raise _fail(text, f"unexpected {text[i]!r} at position {i}")
        kind = m.lastgroup
        out.append((kind, m.group(kind), m.start(kind)))
        i = m.end()


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokenize(text)
        self.i = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.toks[self.i][1] if self.i < len(self.toks) else None

    def take(self, want: str | None = None) -> tuple[str, str, int]:
        if self.i >= len(self.toks):
            raise _fail(self.text, "it ends early" + (f" (expected {want!r})" if want else ""))
        tok = self.toks[self.i]
        if want is not None and tok[1] != want:
            raise _fail(self.text, f"expected {want!r} at position {tok[2]}, found {tok[1]!r}")
        self.i += 1
        return tok

    def parse(self) -> Tree:
        if not self.toks:
            raise _fail(self.text, "it is empty")
        tree = self.expr()
        if self.i != len(self.toks):
            kind, val, pos = self.toks[self.i]
            raise _fail(self.text, f"unexpected {val!r} at position {pos}")
        return tree

    def expr(self) -> Tree:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _fail(self.text, f"it nests deeper than {MAX_DEPTH} levels")
        tree = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()[1]
            tree = ("add" if op == "+" else "sub", tree, self.term())
        self.depth -= 1
        return tree

    def term(self) -> Tree:
        tree = self.unary()
        ops = {"*": "mul", "/": "div", "//": "floordiv", "%": "mod"}
        while self.peek() in ops:
            tree = (ops[self.take()[1]], tree, self.unary())
        return tree

    def unary(self) -> Tree:
        if self.peek() in ("-", "+"):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise _fail(self.text, f"it nests deeper than {MAX_DEPTH} levels")
            neg = self.take()[1] == "-"
            inner = self.unary()
            self.depth -= 1
            return ("neg", inner) if neg else inner
        return self.power()

    def power(self) -> Tree:
        base = self.atom()
        if self.peek() != "**":
            return base
        self.take()
        sign = 1
        if self.peek() == "-":
            self.take()
            sign = -1
        kind, val, pos = self.take()
        if kind != "int" or int(val) > MAX_EXPONENT:
            raise _fail(self.text, f"'**' takes an integer exponent up to {MAX_EXPONENT}; found {val!r} at position {pos}")
        return ("pow", base, sign * int(val))

    def atom(self) -> Tree:
        kind, val, pos = self.take()
        if kind == "int":
            if len(val) > MAX_INT_DIGITS:
                raise _fail(self.text, f"the integer at position {pos} has more than {MAX_INT_DIGITS} digits")
            return ("int", int(val))
        if val == "(":
            tree = self.expr()
            self.take(")")
            return tree
        if kind == "name":
            if val in FUNCTIONS:
                return self.call(val, pos)
            if self.peek() == "(":
                raise _fail(self.text, f"{val!r} at position {pos} is not a function of the dim grammar")
            if keyword.iskeyword(val) or val.startswith("__"):
                raise _fail(self.text, f"{val!r} at position {pos} cannot name a symbol")
            return ("sym", val)
        raise _fail(self.text, f"unexpected {val!r} at position {pos}")

    def call(self, fn: str, pos: int) -> Tree:
        if self.peek() != "(":
            raise _fail(self.text, f"{fn!r} at position {pos} is a function; call it as {fn}(...)")
        self.take("(")
        args = [self.expr()]
        while self.peek() == ",":
            self.take()
            args.append(self.expr())
        self.take(")")
        lo, hi = FUNCTIONS[fn]
        if not lo <= len(args) <= hi:
            raise _fail(self.text, f"{fn} takes {lo}{'' if lo == hi else f' to {hi}'} argument(s), got {len(args)}")
        return ("call", fn, tuple(args))


@functools.lru_cache(maxsize=16384)
def parse_tree(text: str) -> Tree:
    """The syntax tree of a dim string; raises DimError naming the string and what is wrong."""
    if not isinstance(text, str):
        raise DimError(f"dimension {text!r} is a {type(text).__name__}, not an int or a string")
    if len(text) > MAX_LENGTH:
        raise DimError(f"dimension {text[:60]!r}... is {len(text)} characters long (at most {MAX_LENGTH})")
    tree = _Parser(text).parse()
    if _pow_nesting(tree) > MAX_POWER_NESTING:
        raise _fail(text, f"powers nest more than {MAX_POWER_NESTING} deep")
    return tree


def _pow_nesting(t: Tree) -> int:
    if t[0] in ("int", "sym"):
        return 0
    if t[0] == "pow":
        return 1 + _pow_nesting(t[1])
    if t[0] == "call":
        return max(_pow_nesting(a) for a in t[2])
    return max(_pow_nesting(x) for x in t[1:] if isinstance(x, tuple))


# ---- sympy -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def symbol(name: str):  # -> sympy.Symbol
    """Symbols are sizes: positive integers (what lets ceiling(n) fold to n)."""
    import sympy

    return sympy.Symbol(name, integer=True, positive=True)


def _build(t: Tree):  # -> sympy.Expr
    import sympy

    k = t[0]
    if k == "int":
        return sympy.Integer(t[1])
    if k == "sym":
        return symbol(t[1])
    if k == "neg":
        return -_build(t[1])
    if k == "pow":
        return sympy.Pow(_build(t[1]), sympy.Integer(t[2]))
    if k == "call":
        args = [_build(a) for a in t[2]]
        fn = {"ceiling": sympy.ceiling, "floor": sympy.floor, "Max": sympy.Max, "Min": sympy.Min,
              "Mod": sympy.Mod, "PythonMod": sympy.Mod, "CeilToInt": sympy.ceiling, "FloorToInt": sympy.floor,
              "FloorDiv": lambda a, b: sympy.floor(a / b), "IntTrueDiv": lambda a, b: a / b,
              "ModularIndexing": lambda x, d, m: sympy.Mod(sympy.floor(x / d), m)}[t[1]]
        return fn(*args)
    a, b = _build(t[1]), _build(t[2])
    if k == "add":
        return a + b
    if k == "sub":
        return a - b
    if k == "mul":
        return a * b
    if k == "div":
        return a / b
    if k == "floordiv":
        return sympy.floor(a / b)
    if k == "mod":
        return sympy.Mod(a, b)
    raise AssertionError(k)


def _check_finite(text: str, expr: Any) -> Any:
    import sympy

    if expr.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo):
        raise DimError(f"dimension {text!r} is not finite (it divides by zero)")
    return expr


@functools.lru_cache(maxsize=16384)
def parse_dim(text: str):  # -> sympy.Expr
    """A dim string as a sympy expression over positive-integer symbols, built without sympify."""
    return _check_finite(text, _build(parse_tree(text)))


@functools.lru_cache(maxsize=16384)
def canonical_dim(text: str) -> int | str:
    """The canonical form of a dim string: an int when constant, else sympy's spelling expanded.

    ``sympy.expand`` gives polynomials (with floor/ceiling/Max/... as atoms) one spelling, so
    equal sizes compare equal as strings; it replaces ``sympy.simplify``, which cost most of a
    compile and is no more canonical. The result is checked to read back to itself.
    """
    import sympy

    expr = _check_finite(text, sympy.expand(parse_dim(text)))
    if expr.is_Integer:
        return int(expr)
    if not expr.free_symbols:
        raise DimError(f"dimension {text!r} is the constant {expr}, not an integer")
    out = str(expr)
    if out != text:
        try:
            again = sympy.expand(parse_dim(out))
        except DimError as e:
            raise AssertionError(f"canonical spelling {out!r} of dimension {text!r} is outside the dim grammar") from e
        if again != expr:
            raise AssertionError(f"canonical spelling {out!r} of dimension {text!r} does not read back to itself")
    return out


def dim_names(text: str) -> frozenset[str]:
    """The symbols a dim string uses."""
    return _names(parse_tree(text))


@functools.lru_cache(maxsize=16384)
def _names(t: Tree) -> frozenset[str]:
    if t[0] == "sym":
        return frozenset([t[1]])
    if t[0] in ("int",):
        return frozenset()
    if t[0] == "call":
        return frozenset().union(*(_names(a) for a in t[2]))
    if t[0] in ("neg", "pow"):
        return _names(t[1])
    return _names(t[1]) | _names(t[2])


def rename_symbols(text: str, mapping: Mapping[str, str]) -> str:
    """sympy's spelling of a dim with symbols renamed (e.g. num_tokens -> T for host code)."""
    expr = parse_dim(text)
    return str(expr.xreplace({symbol(k): symbol(v) for k, v in mapping.items()}))


# ---- evaluation --------------------------------------------------------------------------------
Number = int | Fraction


def _floor(x: Number) -> int:
    return math.floor(x)


def _ceil(x: Number) -> int:
    return math.ceil(x)


def _compile(t: Tree) -> Callable[[Mapping[str, int]], Number]:
    k = t[0]
    if k == "int":
        v = t[1]
        return lambda b: v
    if k == "sym":
        n = t[1]
        return lambda b: int(b[n])
    if k == "neg":
        f = _compile(t[1])
        return lambda b: -f(b)
    if k == "pow":
        f, e = _compile(t[1]), t[2]
        return lambda b: Fraction(f(b)) ** e if e < 0 else f(b) ** e
    if k == "call":
        fs = [_compile(a) for a in t[2]]
        name = t[1]
        if name in ("ceiling", "CeilToInt"):
            return lambda b: _ceil(fs[0](b))
        if name in ("floor", "FloorToInt"):
            return lambda b: _floor(fs[0](b))
        if name == "Max":
            return lambda b: max(f(b) for f in fs)
        if name == "Min":
            return lambda b: min(f(b) for f in fs)
        if name == "FloorDiv":
            return lambda b: _floor(Fraction(fs[0](b)) / fs[1](b))
        if name == "IntTrueDiv":
            return lambda b: Fraction(fs[0](b)) / fs[1](b)
        if name == "ModularIndexing":
            return lambda b: _floor(Fraction(fs[0](b)) / fs[1](b)) % fs[2](b)
        return lambda b: fs[0](b) % fs[1](b)  # Mod / PythonMod: the sign of the divisor, as sympy and Python
    fa, fb = _compile(t[1]), _compile(t[2])
    ops: dict[str, Callable[[Number, Number], Number]] = {
        "add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
        "div": lambda x, y: Fraction(x) / y, "floordiv": lambda x, y: _floor(Fraction(x) / y),
        "mod": lambda x, y: x % y,
    }  # fmt: skip
    op = ops[k]
    return lambda b: op(fa(b), fb(b))


@functools.lru_cache(maxsize=16384)
def dim_evaluator(text: str) -> tuple[tuple[str, ...], Callable[[Mapping[str, int]], Number]]:
    """(symbol names, exact evaluator of the parsed tree); the text itself never runs."""
    tree = parse_tree(text)
    return tuple(sorted(_names(tree))), _compile(tree)


def evaluate_dim(text: str, bindings: Mapping[str, int]) -> int:
    """The integer value of a dim string under symbol bindings; raises naming the dim."""
    names, fn = dim_evaluator(text)
    missing = [n for n in names if n not in bindings]
    if missing:
        raise KeyError(f"dimension {text!r} needs values for symbols {missing}; bound: {dict(bindings)}")
    try:
        v = fn(bindings)
    except ZeroDivisionError:
        raise DimError(f"dimension {text!r} divides by zero at {dict(bindings)}") from None
    if isinstance(v, Fraction):
        if v.denominator != 1:
            raise DimError(f"dimension {text!r} is {v} at {dict(bindings)}, not an integer")
        v = int(v)
    return v
