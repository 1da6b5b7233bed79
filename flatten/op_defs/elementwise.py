"""Pointwise ops: unary math, binary arithmetic with broadcasting, comparisons, where, cast."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from portlayer.flatten.ir import TensorType, dtype_name, torch_dtype
from portlayer.flatten.ops import broadcast_shapes, op, out_numel_flops


def _same(ins: list[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    return [ins[0]]


def _float_like(ins: list[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    t = ins[0]
    if t.dtype in ("int64", "int32", "int16", "int8", "uint8", "bool"):
        return [t.with_dtype("float32")]
    return [t]


def _unary(name: str, fn, flops: int = 1, float_out: bool = False) -> None:
    def ref(x: torch.Tensor) -> torch.Tensor:
        return fn(x)

    ref.__doc__ = f"Elementwise {name}."
    op(name, kind="pointwise", inputs=("x",), infer=_float_like if float_out else _same, flops=out_numel_flops(flops))(ref)


_unary("neg", torch.neg)
_unary("abs", torch.abs)
_unary("exp", torch.exp, 4, True)
_unary("log", torch.log, 4, True)
_unary("sqrt", torch.sqrt, 2, True)
_unary("rsqrt", torch.rsqrt, 2, True)
_unary("reciprocal", torch.reciprocal, 1, True)
_unary("cos", torch.cos, 8, True)
_unary("sin", torch.sin, 8, True)
_unary("tanh", torch.tanh, 6, True)
_unary("erf", torch.erf, 8, True)
_unary("sigmoid", torch.sigmoid, 5, True)
_unary("relu", torch.relu)
_unary("silu", F.silu, 6, True)
op("logical_not", kind="pointwise", inputs=("x",), infer=lambda ins, a: [ins[0].with_dtype("bool")],
   flops=out_numel_flops(1))(lambda x: torch.logical_not(x))


@op("gelu", kind="pointwise", inputs=("x",), attrs={"approximate": "none"}, infer=_same, flops=out_numel_flops(10))
def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU; approximate='none' is the exact erf form, 'tanh' the tanh approximation (GPT-2's gelu_new)."""
    return F.gelu(x, approximate=approximate)


@op("clamp", kind="pointwise", inputs=("x",), attrs={"min": None, "max": None}, infer=_same, flops=out_numel_flops(2))
def clamp(x: torch.Tensor, min: float | None = None, max: float | None = None) -> torch.Tensor:
    """Clamp into [min, max]; either bound may be absent."""
    return torch.clamp(x, min=min, max=max)


@op("cast", kind="pointwise", inputs=("x",), attrs={"dtype": "float32"},
    infer=lambda ins, a: [ins[0].with_dtype(dtype_name(a["dtype"]))], flops=out_numel_flops(0))
def cast(x: torch.Tensor, dtype: str = "float32") -> torch.Tensor:
    """Convert to ``dtype`` (round to nearest even, like torch .to())."""
    return x.to(torch_dtype(dtype))


def _result_dtype(fn, ins: list[TensorType | None], scalar: Any, reverse: bool) -> str:
    a = torch.zeros(1, dtype=torch_dtype(ins[0].dtype))
    b = torch.zeros(1, dtype=torch_dtype(ins[1].dtype)) if len(ins) > 1 and ins[1] is not None else scalar
    if b is None:
        b = 0
    return dtype_name((fn(b, a) if reverse else fn(a, b)).dtype)


def _binary(name: str, fn, flops: int = 1, doc: str = "") -> None:
    def infer(ins: list[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
        shapes = [t.shape for t in ins if t is not None]
        if (len(ins) < 2 or ins[1] is None) and attrs.get("scalar") is None:
            raise ValueError(f"op {name!r} needs a second input or a 'scalar' attribute")
        dtype = _result_dtype(fn, ins, attrs.get("scalar"), attrs.get("reverse", False))
        return [TensorType(dtype, broadcast_shapes(*shapes))]

    def ref(a: torch.Tensor, b: torch.Tensor | None = None, scalar: Any = None, reverse: bool = False):
        other = b if b is not None else scalar
        return fn(other, a) if reverse else fn(a, other)

    ref.__doc__ = doc or f"Elementwise {name} with broadcasting; a missing second input uses attribute 'scalar' ('reverse' puts it first)."
    op(name, kind="pointwise", inputs=("a", "b?"), attrs={"scalar": None, "reverse": False}, infer=infer,
       flops=out_numel_flops(flops))(ref)


_binary("add", torch.add)
_binary("sub", torch.sub)
_binary("mul", torch.mul)
_binary("div", torch.div, 4)
_binary("pow", torch.pow, 4)
_binary("maximum", lambda a, b: torch.maximum(a, b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=a.dtype)))
_binary("minimum", lambda a, b: torch.minimum(a, b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=a.dtype)))
_binary("eq", torch.eq)
_binary("ne", torch.ne)
_binary("lt", torch.lt)
_binary("le", torch.le)
_binary("gt", torch.gt)
_binary("ge", torch.ge)
_binary("logical_and", lambda a, b: torch.logical_and(a, torch.as_tensor(b)))
_binary("logical_or", lambda a, b: torch.logical_or(a, torch.as_tensor(b)))


def _where_infer(ins: list[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    shapes = [ins[0].shape] + [t.shape for t in ins[1:] if t is not None]
    vals = [t for t in ins[1:] if t is not None]
    if not vals:
        dtype = dtype_name(torch.result_type(torch.tensor(0 if attrs["x_scalar"] is None else attrs["x_scalar"]),
                                             torch.tensor(0 if attrs["y_scalar"] is None else attrs["y_scalar"])))
    elif len(vals) == 2:
        dtype = dtype_name(torch.promote_types(torch_dtype(vals[0].dtype), torch_dtype(vals[1].dtype)))
    else:
        dtype = vals[0].dtype
    return [TensorType(dtype, broadcast_shapes(*shapes))]


@op("where", kind="pointwise", inputs=("cond", "x?", "y?"), attrs={"x_scalar": None, "y_scalar": None},
    infer=_where_infer, flops=out_numel_flops(1))
def where(cond: torch.Tensor, x: torch.Tensor | None = None, y: torch.Tensor | None = None,
          x_scalar: float | None = None, y_scalar: float | None = None) -> torch.Tensor:
    """Select x where cond else y; a missing tensor operand is its scalar attribute."""
    xv = x if x is not None else torch.tensor(x_scalar, dtype=(y.dtype if y is not None else None))
    yv = y if y is not None else torch.tensor(y_scalar, dtype=(x.dtype if x is not None else None))
    return torch.where(cond, xv, yv)


def gelu_tanh_reference(x: torch.Tensor) -> torch.Tensor:
    """The textbook tanh-approximate GELU, for tests that want an independent formula."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
