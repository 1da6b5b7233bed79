"""Pointwise expression generation: a chain of Flat IR pointwise nodes -> Triton statements.

Used by the pointwise kernel and by the epilogues of the GEMM and row-reduction kernels,
so every fused chain is written by one function from the IR itself (no per-model code).
Float values are computed in float32 and rounded once at the store; integer and boolean
values keep their type.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from portlayer.codegen.spec import FLOAT_DTYPES, TL_DTYPE
from portlayer.flatten.ir import Node, TensorType, normalize_dim


class Unsupported(NotImplementedError):
    """This chain cannot be expressed in the template; the host falls back to the reference op."""


@dataclass
class Operand:
    """A tensor read from outside the chain: ``var`` is its local name, ``index`` its offset."""

    value: str
    var: str
    dtype: str
    index: str


@dataclass
class Body:
    operands: list[Operand] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    results: dict[str, str] = field(default_factory=dict)  # IR value -> local variable


@dataclass(frozen=True)
class IndexContext:
    """How a kernel addresses its output tile: the flat offset, and (2-D kernels) row/column."""

    full: str
    mask: str
    row: str | None = None
    col: str | None = None


def _lit(x: Any) -> str:
    if isinstance(x, bool):
        return "1" if x else "0"
    if isinstance(x, float) and not math.isfinite(x):  # repr gives the bare names inf / nan, undefined in a kernel
        return "float('nan')" if math.isnan(x) else ("float('inf')" if x > 0 else "float('-inf')")
    return repr(x)


def _numel(dims: Sequence[Any]) -> int:
    n = 1
    for d in dims:
        if not isinstance(d, int):
            raise Unsupported(f"broadcast over symbolic dim {d!r}")
        n *= d
    return n


def broadcast_index(shape: Sequence[Any], out: Sequence[Any], ctx: IndexContext) -> str:
    """Offset of an input of ``shape`` broadcast to ``out``, for the three layouts models use."""
    s = [normalize_dim(d) for d in shape]
    o = [normalize_dim(d) for d in out]
    s = [1] * (len(o) - len(s)) + s
    if s == o:
        return ctx.full
    if all(d == 1 for d in s):
        return "0"
    lead = next(i for i, d in enumerate(s) if d != 1)
    if s[lead:] == o[lead:]:  # a trailing block such as a bias [N]: repeats every numel(block)
        if lead == len(o) - 1 and ctx.col is not None:
            return ctx.col
        return f"({ctx.full}) % {_numel(o[lead:])}"
    tail = max(i for i, d in enumerate(s) if d != 1)
    if s[: tail + 1] == o[: tail + 1] and all(d == 1 for d in s[tail + 1 :]):  # e.g. [T, 1] per-row
        if tail == len(o) - 2 and ctx.row is not None:
            return ctx.row
        return f"({ctx.full}) // {_numel(o[tail + 1 :])}"
    raise Unsupported(f"broadcast of {shape} to {out}")


def _binary(sym: str) -> Callable[[list[str], Mapping[str, Any]], str]:
    return lambda a, attrs: f"{a[0]} {sym} {a[1]}"


def _pow(a: list[str], attrs: Mapping[str, Any]) -> str:
    e = attrs.get("scalar")
    if e == 2 or e == 2.0:
        return f"{a[0]} * {a[0]}"
    if e == 3 or e == 3.0:
        return f"{a[0]} * {a[0]} * {a[0]}"
    if e == 0.5:
        return f"tl.sqrt({a[0]})"
    if e == -0.5:
        return f"tl.rsqrt({a[0]})"
    # General power through exp2/log2: exact for positive bases, which is what models use.
    return f"tl.exp2(tl.log2({a[0]}) * {a[1]})"


def _gelu(a: list[str], attrs: Mapping[str, Any]) -> str:
    x = a[0]
    if attrs.get("approximate", "none") == "tanh":
        inner = f"0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})"
        return f"0.5 * {x} * (1.0 + (2.0 * tl.sigmoid(2.0 * ({inner})) - 1.0))"
    return f"0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))"


def _clamp(a: list[str], attrs: Mapping[str, Any]) -> str:
    x = a[0]
    if attrs.get("min") is not None:
        x = f"tl.maximum({x}, {_lit(float(attrs['min']))})"
    if attrs.get("max") is not None:
        x = f"tl.minimum({x}, {_lit(float(attrs['max']))})"
    return x


EXPRESSIONS: dict[str, Callable[[list[str], Mapping[str, Any]], str]] = {
    "neg": lambda a, _: f"-{a[0]}",
    "abs": lambda a, _: f"tl.abs({a[0]})",
    "exp": lambda a, _: f"tl.exp({a[0]})",
    "log": lambda a, _: f"tl.log({a[0]})",
    "sqrt": lambda a, _: f"tl.sqrt({a[0]})",
    "rsqrt": lambda a, _: f"tl.rsqrt({a[0]})",
    "reciprocal": lambda a, _: f"1.0 / {a[0]}",
    "cos": lambda a, _: f"tl.cos({a[0]})",
    "sin": lambda a, _: f"tl.sin({a[0]})",
    "tanh": lambda a, _: f"2.0 * tl.sigmoid(2.0 * {a[0]}) - 1.0",
    "erf": lambda a, _: f"tl.erf({a[0]})",
    "sigmoid": lambda a, _: f"tl.sigmoid({a[0]})",
    "relu": lambda a, _: f"tl.maximum({a[0]}, 0.0)",
    "silu": lambda a, _: f"{a[0]} * tl.sigmoid({a[0]})",
    "logical_not": lambda a, _: f"{a[0]} == 0",
    "gelu": _gelu,
    "clamp": _clamp,
    "add": _binary("+"),
    "sub": _binary("-"),
    "mul": _binary("*"),
    "div": _binary("/"),
    "pow": _pow,
    "maximum": lambda a, _: f"tl.maximum({a[0]}, {a[1]})",
    "minimum": lambda a, _: f"tl.minimum({a[0]}, {a[1]})",
    "eq": _binary("=="),
    "ne": _binary("!="),
    "lt": _binary("<"),
    "le": _binary("<="),
    "gt": _binary(">"),
    "ge": _binary(">="),
    "logical_and": lambda a, _: f"({a[0]} != 0) & ({a[1]} != 0)",
    "logical_or": lambda a, _: f"({a[0]} != 0) | ({a[1]} != 0)",
    "where": lambda a, _: f"tl.where({a[0]}, {a[1]}, {a[2]})",
}
BINARY = {"add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
          "logical_and", "logical_or"}  # fmt: skip
POINTWISE_OPS = frozenset(EXPRESSIONS) | {"cast"}
FLOAT_MATH = {"exp", "log", "sqrt", "rsqrt", "reciprocal", "cos", "sin", "tanh", "erf", "sigmoid", "silu", "gelu",
              "div", "pow"}


def _cast(x: str, dtype: str) -> str:
    if dtype in ("float16", "bfloat16"):  # round like torch's .to(), keep computing in float32
        return f"{x}.to({TL_DTYPE[dtype]}).to(tl.float32)"
    return f"{x}.to({TL_DTYPE[dtype]})"


def lower_chain(
    nodes: Sequence[Node],
    types: Mapping[str, TensorType],
    out_shape: Sequence[Any],
    ctx: IndexContext,
    bound: Mapping[str, str] | None = None,
    prefix: str = "x",
) -> Body:
    """Statements computing ``nodes`` in order; ``bound`` maps values already in registers."""
    body = Body()
    env: dict[str, str] = dict(bound or {})

    def operand(value: str) -> str:
        if value in env:
            return env[value]
        t = types[value]
        var = f"{prefix}{len(body.operands)}"
        idx = broadcast_index(t.shape, out_shape, ctx)
        body.operands.append(Operand(value, var, t.dtype, idx))
        env[value] = var
        return var

    for i, n in enumerate(nodes):
        if n.op not in POINTWISE_OPS:
            raise Unsupported(f"op {n.op!r} is not pointwise-fusable")
        args = [operand(v) for v in n.inputs if v is not None]
        if n.op in FLOAT_MATH and n.outputs[0].type.dtype in FLOAT_DTYPES:
            # integer inputs promote to float (torch.exp(int) is float): compute in float32
            args = [a if types[v].dtype in FLOAT_DTYPES else f"{a}.to(tl.float32)"
                    for a, v in zip(args, [i for i in n.inputs if i is not None])]
        attrs = n.attrs
        if n.op in BINARY and len(args) == 1:
            s = attrs["scalar"]
            if isinstance(s, int) and not isinstance(s, bool) and types[n.inputs[0]].dtype in FLOAT_DTYPES:
                s = float(s)
            scalar = _lit(s)
            args = [scalar, args[0]] if attrs.get("reverse") else [args[0], scalar]
        elif n.op == "where":
            full = [operand(v) if v is not None else None for v in n.inputs] + [None] * (3 - len(n.inputs))
            args = [full[0], full[1] or _lit(attrs["x_scalar"]), full[2] or _lit(attrs["y_scalar"])]
        expr = _cast(args[0], attrs["dtype"]) if n.op == "cast" else EXPRESSIONS[n.op](args, attrs)
        var = f"t{i}"
        body.lines.append(f"{var} = {expr}  # {n.op}")
        env[n.outputs[0].name] = var
        body.results[n.outputs[0].name] = var
    return body


def load_line(op: Operand, ptr: str, mask: str) -> str:
    """tl.load of an operand, widened to float32 when it is a float."""
    load = f"tl.load({ptr} + {op.index}, mask={mask}, other=0)" if op.index != "0" else f"tl.load({ptr})"
    return f"{op.var} = {load}" + (".to(tl.float32)" if op.dtype in FLOAT_DTYPES else "")
