"""Layout and data-movement ops: reshape, transpose/permute, expand, slice, concat, gather, creation."""

from __future__ import annotations

from typing import Any

import sympy
import torch

from portlayer.flatten.ir import Dim, TensorType, normalize_dim, to_sympy, torch_dtype
from portlayer.flatten.ops import norm_axis, op

BIG = 2**62


def _sym(d: Dim) -> sympy.Expr:
    return to_sympy(d)


def resolve_shape(in_shape: tuple[Dim, ...], target: list[Dim]) -> tuple[Dim, ...]:
    """Fill a single -1 in ``target`` so that the element count matches ``in_shape``."""
    total = sympy.Integer(1)
    for d in in_shape:
        total *= _sym(d)
    if sum(1 for d in target if d == -1) > 1:
        raise ValueError(f"reshape target {target} has more than one -1")
    known = sympy.Integer(1)
    for d in target:
        if d != -1:
            known *= _sym(d)
    if -1 in target:
        missing = sympy.cancel(total / known)  # a ratio of products: cancel is exact and cheap
        return tuple(normalize_dim(missing) if d == -1 else normalize_dim(d) for d in target)
    if sympy.expand(total - known) != 0 and sympy.simplify(total - known) != 0:  # simplify only to refuse
        raise ValueError(f"cannot reshape {list(in_shape)} to {target}: element counts differ")
    return tuple(normalize_dim(d) for d in target)


def _reshape_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    return [ins[0].with_shape(resolve_shape(ins[0].shape, list(a["shape"])))]


def bind_shape(shape: list[Dim], x: torch.Tensor, bindings: dict[str, int] | None) -> list[int]:
    out = []
    for d in shape:
        if isinstance(d, int):
            out.append(d)
        else:
            if bindings is None:
                raise ValueError(f"symbolic dim {d!r} needs bindings at run time")
            from portlayer.flatten.ir import eval_dim

            out.append(eval_dim(d, bindings))
    return out


@op("reshape", kind="view", inputs=("x",), attrs={"shape": []}, infer=_reshape_infer, needs_context=True)
def reshape(x: torch.Tensor, shape: list[Dim], ctx: Any = None) -> torch.Tensor:
    """Reshape (a view where strides allow). One -1 is inferred; symbols bind from the context."""
    return x.reshape(bind_shape(shape, x, getattr(ctx, "bindings", None)))


def _transpose_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    s = list(ins[0].shape)
    i, j = norm_axis(a["dim0"], len(s)), norm_axis(a["dim1"], len(s))
    s[i], s[j] = s[j], s[i]
    return [ins[0].with_shape(s)]


@op("transpose", kind="view", inputs=("x",), attrs={"dim0": 0, "dim1": 1}, infer=_transpose_infer)
def transpose(x: torch.Tensor, dim0: int = 0, dim1: int = 1) -> torch.Tensor:
    """Swap two axes."""
    return x.transpose(dim0, dim1)


def _permute_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    s = ins[0].shape
    return [ins[0].with_shape([s[norm_axis(d, len(s))] for d in a["dims"]])]


@op("permute", kind="view", inputs=("x",), attrs={"dims": []}, infer=_permute_infer)
def permute(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """Reorder axes."""
    return x.permute(*dims)


def _expand_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    s = ins[0].shape
    tgt = list(a["shape"])
    off = len(tgt) - len(s)
    out = [s[i - off] if (d == -1 and i >= off) else d for i, d in enumerate(tgt)]
    return [ins[0].with_shape(out)]


@op("expand", kind="view", inputs=("x",), attrs={"shape": []}, infer=_expand_infer, needs_context=True)
def expand(x: torch.Tensor, shape: list[Dim], ctx: Any = None) -> torch.Tensor:
    """Broadcast size-1 axes to ``shape`` (-1 keeps an axis)."""
    return x.expand(*bind_shape(shape, x, getattr(ctx, "bindings", None)))


def slice_len(size: Dim, start: int, end: Dim | None, step: int) -> Dim:
    s = _sym(size)
    st = sympy.Integer(start)
    if start < 0:
        st = s + start
    if end is None or (isinstance(end, int) and end >= BIG):
        en = s
    elif isinstance(end, int) and end < 0:
        en = s + end
    else:
        en = _sym(end)
        if isinstance(size, int) and isinstance(end, int):
            en = sympy.Integer(min(end, size))
    n = sympy.ceiling((en - st) / step)
    return normalize_dim(n)


def _slice_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    s = list(ins[0].shape)
    d = norm_axis(a["dim"], len(s))
    s[d] = slice_len(s[d], a["start"], a["end"], a["step"])
    return [ins[0].with_shape(s)]


@op("slice", kind="view", inputs=("x",), attrs={"dim": 0, "start": 0, "end": None, "step": 1},
    infer=_slice_infer, needs_context=True)
def slice_(x: torch.Tensor, dim: int = 0, start: int = 0, end: Dim | None = None, step: int = 1,
           ctx: Any = None) -> torch.Tensor:
    """x[..., start:end:step, ...] along ``dim``; end None means to the end."""
    if isinstance(end, str):
        end = bind_shape([end], x, getattr(ctx, "bindings", None))[0]
    idx = [slice(None)] * x.dim()
    idx[dim] = slice(start, end, step)
    return x[tuple(idx)]


def _concat_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    base = list(ins[0].shape)
    d = norm_axis(a["dim"], len(base))
    total = sympy.Integer(0)
    for t in ins:
        total += _sym(t.shape[d])
    base[d] = normalize_dim(total)
    dtype = ins[0].dtype
    for t in ins[1:]:
        dtype = str(torch.promote_types(torch_dtype(dtype), torch_dtype(t.dtype))).replace("torch.", "")
    return [TensorType(dtype, base)]


@op("concat", kind="data", inputs=("xs",), attrs={"dim": 0}, infer=_concat_infer, variadic=True)
def concat(*xs: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Concatenate along ``dim``."""
    return torch.cat(xs, dim=dim)


def _index_select_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    s = list(ins[0].shape)
    d = norm_axis(a["dim"], len(s))
    return [ins[0].with_shape(s[:d] + list(ins[1].shape) + s[d + 1:])]


@op("index_select", kind="data", inputs=("x", "index"), attrs={"dim": 0}, infer=_index_select_infer)
def index_select(x: torch.Tensor, index: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Gather slices of ``x`` along ``dim`` at ``index`` (any index shape; it replaces the axis)."""
    out = torch.index_select(x, dim, index.reshape(-1).long())
    shape = list(x.shape[:dim]) + list(index.shape) + list(x.shape[dim + 1:])
    return out.reshape(shape)


@op("gather", kind="data", inputs=("x", "index"), attrs={"dim": 0},
    infer=lambda ins, a: [ins[0].with_shape(ins[1].shape)])
def gather(x: torch.Tensor, index: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """torch.gather: out[i][j] = x[index[i][j]][j] along ``dim``."""
    return torch.gather(x, dim, index.long())


@op("full", kind="creation", inputs=(), attrs={"shape": [], "value": 0.0, "dtype": "float32"},
    infer=lambda ins, a: [TensorType(a["dtype"], tuple(a["shape"]))], needs_context=True)
def full(shape: list[Dim], value: float = 0.0, dtype: str = "float32", ctx: Any = None) -> torch.Tensor:
    """A tensor filled with ``value``; symbolic dims bind from the context."""
    dims = bind_shape(shape, None, getattr(ctx, "bindings", None))
    return torch.full(dims, value, dtype=torch_dtype(dtype), device=getattr(ctx, "device", "cpu"))


def _arange_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    n = sympy.ceiling((_sym(a["end"]) - a["start"]) / a["step"])
    return [TensorType(a["dtype"], (normalize_dim(n),))]


@op("arange", kind="creation", inputs=(), attrs={"start": 0, "end": 0, "step": 1, "dtype": "int64"},
    infer=_arange_infer, needs_context=True)
def arange(start: int = 0, end: Dim = 0, step: int = 1, dtype: str = "int64", ctx: Any = None) -> torch.Tensor:
    """start, start+step, ... < end; a symbolic end binds from the context."""
    e = bind_shape([end], None, getattr(ctx, "bindings", None))[0]
    return torch.arange(start, e, step, dtype=torch_dtype(dtype), device=getattr(ctx, "device", "cpu"))
