"""The aten -> portable op table used by from_export (one handler per aten op family)."""

from __future__ import annotations

import operator
from typing import Any

import torch

from portlayer.flatten.from_export import Converter, Sym, UnsupportedOpError, lower
from portlayer.flatten.ir import dtype_name

aten = torch.ops.aten
Node = torch.fx.Node


def _is_tensor(v: Any) -> bool:
    return isinstance(v, str)


def _scalar(v: Any) -> Any:
    if isinstance(v, Sym):
        raise UnsupportedOpError(f"symbolic scalar {v.dim} used as an arithmetic operand")
    return v


# ---- no-ops and bookkeeping ----------------------------------------------------------------


@lower(aten._assert_tensor_metadata, aten._assert_scalar, aten.sym_constrain_range_for_size,
       aten.sym_constrain_range, torch.ops.aten._assert_async)
def _skip(cv: Converter, node: Node, args: list, kwargs: dict) -> None:
    return None


@lower(aten.clone, aten.contiguous, aten.alias, aten.detach, aten.lift_fresh_copy, aten.dropout,
       aten.feature_dropout, aten.alpha_dropout, aten.native_dropout)
def _identity(cv: Converter, node: Node, args: list, kwargs: dict) -> Any:
    return args[0]


@lower(aten.sym_size)
def _sym_size(cv: Converter, node: Node, args: list, kwargs: dict) -> Sym:
    return Sym(cv.dim(node.meta["val"]))


@lower(operator.getitem)
def _getitem(cv: Converter, node: Node, args: list, kwargs: dict) -> Any:
    return args[0][args[1]]


def _sym_arith(cv: Converter, node: Node, args: list, kwargs: dict) -> Sym:
    return Sym(cv.dim(node.meta["val"]))


for _op in (operator.mul, operator.add, operator.sub, operator.floordiv, operator.mod, torch.sym_int,
            torch.sym_max, torch.sym_min, operator.neg):
    lower(_op)(_sym_arith)


# ---- dtype conversion ---------------------------------------------------------------------------


@lower(aten.to, aten._to_copy, aten.type_as)
def _to(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    x = args[0]
    want = cv.out_dtype()
    if cv.type_of(x).dtype == want:
        return x
    return cv.emit("cast", [x], {"dtype": want})


# ---- layout -------------------------------------------------------------------------------------


@lower(aten.view, aten.reshape, aten._unsafe_view, aten.unsqueeze, aten.squeeze, aten.flatten,
       aten.unflatten, aten.view_as, aten.reshape_as)
def _reshape(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    return cv.reshape_to(args[0], cv.out_shape())


@lower(aten.expand, aten.expand_as, aten.broadcast_to)
def _expand(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    shape = cv.out_shape()
    if tuple(cv.type_of(args[0]).shape) == shape:
        return args[0]
    return cv.emit("expand", [args[0]], {"shape": list(shape)})


@lower(aten.transpose)
def _transpose(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    return cv.emit("transpose", [args[0]], {"dim0": int(args[1]), "dim1": int(args[2])})


@lower(aten.t, aten.numpy_T)
def _t(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    rank = cv.type_of(args[0]).rank
    if rank < 2:
        return args[0]
    return cv.emit("transpose", [args[0]], {"dim0": rank - 2, "dim1": rank - 1})


@lower(aten.permute)
def _permute(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    return cv.emit("permute", [args[0]], {"dims": [int(d) for d in args[1]]})


def _slice_bound(cv: Converter, v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, Sym):
        return v.dim
    return int(v)


@lower(aten.slice)
def _slice(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    x = args[0]
    dim = int(args[1]) if len(args) > 1 else 0
    start = _slice_bound(cv, args[2]) if len(args) > 2 else None
    end = _slice_bound(cv, args[3]) if len(args) > 3 else None
    step = int(args[4]) if len(args) > 4 else 1
    shape = cv.type_of(x).shape
    d = dim % len(shape)
    out_shape = cv.out_shape()
    if tuple(out_shape) == tuple(shape):
        return x
    if isinstance(end, int) and (end >= 2**62 or (isinstance(shape[d], int) and end >= shape[d])):
        end = None
    if isinstance(start, str):
        raise UnsupportedOpError(f"slice with a symbolic start ({start}) at FX node {node.name}")
    return cv.emit("slice", [x], {"dim": d, "start": start or 0, "end": end, "step": step})


@lower(aten.select)
def _select(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    x, dim, index = args[0], int(args[1]), int(args[2])
    shape = cv.type_of(x).shape
    d = dim % len(shape)
    if shape[d] == 1:
        return cv.reshape_to(x, cv.out_shape())
    end = index + 1 if index != -1 else None
    s = cv.emit("slice", [x], {"dim": d, "start": index, "end": end, "step": 1})
    return cv.reshape_to(s, cv.out_shape())


@lower(aten.cat, aten.concat)
def _cat(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    xs = [x for x in args[0] if _is_tensor(x)]
    dim = int(args[1]) if len(args) > 1 else int(kwargs.get("dim", 0))
    xs = [x for x in xs if cv.type_of(x).numel({"num_tokens": 2}) != 0 or len(xs) == 1]
    if len(xs) == 1:
        return xs[0]
    return cv.emit("concat", xs, {"dim": dim % cv.type_of(xs[0]).rank})


@lower(aten.stack)
def _stack(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    xs = args[0]
    dim = int(args[1]) if len(args) > 1 else 0
    rank = cv.type_of(xs[0]).rank + 1
    d = dim % rank
    parts = []
    for x in xs:
        s = list(cv.type_of(x).shape)
        s.insert(d, 1)
        parts.append(cv.reshape_to(x, tuple(s)))
    return cv.emit("concat", parts, {"dim": d})


@lower(aten.split, aten.split_with_sizes, aten.chunk, aten.unbind, aten.tensor_split)
def _split(cv: Converter, node: Node, args: list, kwargs: dict) -> list[str]:
    x = args[0]
    outs = node.meta["val"]
    target = node.target.overloadpacket
    if target is aten.unbind:
        dim = int(args[1]) if len(args) > 1 else 0
    elif target is aten.chunk:
        dim = int(args[2]) if len(args) > 2 else 0
    else:
        dim = int(args[2]) if len(args) > 2 else int(kwargs.get("dim", 0))
    d = dim % cv.type_of(x).rank
    res, start = [], 0
    for i, o in enumerate(outs):
        size = cv.dim(o.shape[d]) if target is not aten.unbind else 1
        if isinstance(size, str):
            raise UnsupportedOpError(f"split with a symbolic piece size at FX node {node.name}")
        s = cv.emit("slice", [x], {"dim": d, "start": start, "end": start + size, "step": 1})
        res.append(cv.reshape_to(s, cv.out_shape(index=i)))
        start += size
    return res


@lower(aten.repeat_interleave)
def _repeat_interleave(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    """x.repeat_interleave(r, dim) with an int r: unsqueeze after dim, expand, merge."""
    x, reps = args[0], args[1] if len(args) > 1 else kwargs.get("repeats")
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if not isinstance(reps, int) or dim is None:
        raise UnsupportedOpError(f"repeat_interleave with tensor repeats or no dim at FX node {node.name}")
    shape = list(cv.type_of(x).shape)
    d = int(dim) % len(shape)
    up = cv.reshape_to(x, tuple(shape[: d + 1] + [1] + shape[d + 1:]))
    big = cv.emit("expand", [up], {"shape": shape[: d + 1] + [reps] + shape[d + 1:]}, name=f"{node.name}_expand")
    return cv.reshape_to(big, cv.out_shape())


@lower(aten.index)
def _index(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    x, indices = args[0], args[1]
    tensor_idx = [(i, t) for i, t in enumerate(indices) if t is not None]
    if len(tensor_idx) != 1:
        raise UnsupportedOpError(
            f"advanced indexing with {len(tensor_idx)} index tensors at FX node {node.name}; only one is supported"
        )
    d, idx = tensor_idx[0]
    out = cv.emit("index_select", [x, idx], {"dim": d})
    return cv.reshape_to(out, cv.out_shape())


@lower(aten.index_select)
def _index_select(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    return cv.emit("index_select", [args[0], args[2]], {"dim": int(args[1])})


@lower(aten.gather)
def _gather(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    return cv.emit("gather", [args[0], args[2]], {"dim": int(args[1])})


@lower(aten.embedding)
def _embedding(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    return cv.emit("embedding", [args[0], args[1]])


# ---- creation -----------------------------------------------------------------------------------


@lower(aten.zeros_like, aten.ones_like, aten.full_like, aten.new_zeros, aten.new_ones, aten.new_full,
       aten.zeros, aten.ones, aten.full, aten.scalar_tensor, aten.new_empty, aten.empty_like, aten.empty)
def _full(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    target = node.target.overloadpacket
    if target in (aten.zeros_like, aten.zeros, aten.new_zeros, aten.new_empty, aten.empty_like, aten.empty):
        value = 0
    elif target in (aten.ones_like, aten.ones, aten.new_ones):
        value = 1
    elif target is aten.full_like:
        value = args[1]
    elif target is aten.full:
        value = args[1]
    elif target is aten.new_full:
        value = args[2]
    else:  # scalar_tensor
        value = args[0]
    return cv.emit("full", [], {"shape": list(cv.out_shape()), "value": _scalar(value), "dtype": cv.out_dtype()})


@lower(aten.arange)
def _arange(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    nums = [a for a in args if not isinstance(a, torch.dtype)]
    if len(nums) == 1:
        start, end, step = 0, nums[0], 1
    else:
        start, end = nums[0], nums[1]
        step = nums[2] if len(nums) > 2 else 1
    end_dim = end.dim if isinstance(end, Sym) else end
    return cv.emit("arange", [], {"start": int(start), "end": end_dim, "step": int(step), "dtype": cv.out_dtype()})


# ---- arithmetic ---------------------------------------------------------------------------------

_BINARY = {
    aten.add: "add", aten.sub: "sub", aten.mul: "mul", aten.div: "div", aten.pow: "pow",
    aten.maximum: "maximum", aten.minimum: "minimum", aten.eq: "eq", aten.ne: "ne", aten.lt: "lt",
    aten.le: "le", aten.gt: "gt", aten.ge: "ge", aten.logical_and: "logical_and", aten.logical_or: "logical_or",
    aten.bitwise_and: "logical_and", aten.bitwise_or: "logical_or", aten.true_divide: "div",
}


def _binary(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    name = _BINARY[node.target.overloadpacket]
    a, b = args[0], args[1]
    alpha = kwargs.get("alpha", 1)
    if node.target.overloadpacket is aten.div and kwargs.get("rounding_mode"):
        raise UnsupportedOpError(f"div with rounding_mode={kwargs['rounding_mode']!r} at FX node {node.name}")
    if alpha != 1 and _is_tensor(b):
        b = cv.emit("mul", [b], {"scalar": alpha}, name=f"{node.name}_alpha")
    elif alpha != 1:
        b = b * alpha
    want = cv.out_dtype()
    if _is_tensor(a) and _is_tensor(b):
        out = cv.emit(name, [a, b])
    elif _is_tensor(a):
        out = cv.emit(name, [a], {"scalar": _scalar(b)})
    elif _is_tensor(b):
        out = cv.emit(name, [b], {"scalar": _scalar(a), "reverse": True})
    else:
        raise UnsupportedOpError(f"{name} of two scalars at FX node {node.name}")
    if cv.type_of(out).dtype != want:
        out = cv.emit("cast", [out], {"dtype": want})
    return out


for _packet in _BINARY:
    lower(_packet)(_binary)


@lower(aten.rsub)
def _rsub(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    a, b = args[0], args[1]
    alpha = kwargs.get("alpha", 1)
    if alpha != 1:
        a = cv.emit("mul", [a], {"scalar": alpha}, name=f"{node.name}_alpha")
    if _is_tensor(b):
        return cv.emit("sub", [b, a])
    return cv.emit("sub", [a], {"scalar": _scalar(b), "reverse": True})


_UNARY = {
    aten.neg: "neg", aten.exp: "exp", aten.log: "log", aten.sqrt: "sqrt", aten.rsqrt: "rsqrt",
    aten.cos: "cos", aten.sin: "sin", aten.tanh: "tanh", aten.sigmoid: "sigmoid", aten.relu: "relu",
    aten.silu: "silu", aten.abs: "abs", aten.erf: "erf", aten.reciprocal: "reciprocal",
    aten.logical_not: "logical_not", aten.bitwise_not: "logical_not",
}


def _unary(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    return cv.emit(_UNARY[node.target.overloadpacket], [args[0]])


for _packet in _UNARY:
    lower(_packet)(_unary)


@lower(aten.square)
def _square(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    return cv.emit("pow", [args[0]], {"scalar": 2})


@lower(aten.gelu)
def _gelu(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    return cv.emit("gelu", [args[0]], {"approximate": kwargs.get("approximate", args[1] if len(args) > 1 else "none")})


@lower(aten.clamp, aten.clamp_min, aten.clamp_max, aten.hardtanh)
def _clamp(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    t = node.target.overloadpacket
    if t is aten.clamp_min:
        lo, hi = args[1], None
    elif t is aten.clamp_max:
        lo, hi = None, args[1]
    elif t is aten.hardtanh:
        lo, hi = (args[1] if len(args) > 1 else -1.0), (args[2] if len(args) > 2 else 1.0)
    else:
        lo = args[1] if len(args) > 1 else kwargs.get("min")
        hi = args[2] if len(args) > 2 else kwargs.get("max")
    if _is_tensor(lo) or _is_tensor(hi):
        raise UnsupportedOpError(f"clamp with tensor bounds at FX node {node.name}")
    return cv.emit("clamp", [args[0]], {"min": lo, "max": hi})


@lower(aten.where)
def _where(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    cond, x, y = args[0], args[1], args[2]
    attrs: dict[str, Any] = {}
    if not _is_tensor(x):
        attrs["x_scalar"], x = x, None
    if not _is_tensor(y):
        attrs["y_scalar"], y = y, None
    return cv.emit("where", [cond, x, y], attrs)


@lower(aten.masked_fill)
def _masked_fill(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    x, mask, value = args[0], args[1], args[2]
    if _is_tensor(value):
        return cv.emit("where", [mask, value, x])
    return cv.emit("where", [mask, None, x], {"x_scalar": value})


# ---- reductions and normalisation ---------------------------------------------------------------


def _dims(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(d) for d in (v if isinstance(v, (list, tuple)) else [v])]


@lower(aten.mean, aten.sum, aten.amax, aten.amin)
def _reduce(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    name = {aten.mean: "mean", aten.sum: "sum", aten.amax: "amax", aten.amin: "amin"}[node.target.overloadpacket]
    dims = _dims(args[1] if len(args) > 1 else kwargs.get("dim"))
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    dtype = kwargs.get("dtype")
    return cv.emit(name, [args[0]], {"dims": dims, "keepdim": keepdim, "dtype": dtype_name(dtype) if dtype else None})


@lower(aten.softmax, aten._softmax, aten.special_softmax)
def _softmax(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    want = cv.out_dtype()
    x = args[0]
    dtype = want if want != cv.type_of(x).dtype else None
    return cv.emit("softmax", [x], {"dim": int(args[1]), "dtype": dtype})


@lower(aten.layer_norm)
def _layer_norm(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    x, shape = args[0], args[1]
    w = args[2] if len(args) > 2 else kwargs.get("weight")
    b = args[3] if len(args) > 3 else kwargs.get("bias")
    eps = args[4] if len(args) > 4 else kwargs.get("eps", 1e-5)
    if len(shape) != 1:
        raise UnsupportedOpError(f"layer_norm over {len(shape)} trailing dims at FX node {node.name}")
    return cv.emit("layer_norm", [x, w, b], {"eps": float(eps)})


@lower(aten.rms_norm)
def _rms_norm(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    x, shape = args[0], args[1]
    w = args[2] if len(args) > 2 else kwargs.get("weight")
    eps = args[3] if len(args) > 3 else kwargs.get("eps")
    if len(shape) != 1:
        raise UnsupportedOpError(f"rms_norm over {len(shape)} trailing dims at FX node {node.name}")
    if eps is None:
        eps = torch.finfo(torch.float32).eps
    out = cv.emit("rms_norm", [x, w], {"eps": float(eps)})
    if cv.type_of(out).dtype != cv.out_dtype():
        out = cv.emit("cast", [out], {"dtype": cv.out_dtype()})
    return out


# ---- GEMMs ----------------------------------------------------------------------------------------


@lower(aten.linear)
def _linear(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    return cv.emit("linear", [args[0], args[1], b])


def _gemm(cv: Converter, node: Node, x: str, w: str, bias: str | None) -> str:
    """x @ w (+ bias): a parameter ``w`` [K, N] becomes linear with a transposed [N, K] param."""
    if cv.is_param(w) and cv.type_of(w).rank == 2:
        out = cv.emit("linear", [x, cv.param_transposed(w), bias])
    else:
        out = cv.emit("matmul", [x, w])
        if bias is not None:
            out = cv.emit("add", [out, bias], name=f"{node.name}_bias")
    return cv.reshape_to(out, cv.out_shape())


@lower(aten.mm, aten.bmm, aten.matmul)
def _mm(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    return _gemm(cv, node, args[0], args[1], None)


@lower(aten.addmm)
def _addmm(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
        raise UnsupportedOpError(f"addmm with beta/alpha at FX node {node.name}")
    return _gemm(cv, node, args[1], args[2], args[0])


# ---- attention ------------------------------------------------------------------------------------


@lower(torch.ops.portlayer.attention)
def _portlayer_attention(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    q, k, v, scale, causal, window, softcap, layer = args
    qt, kt = cv.type_of(q), cv.type_of(k)
    return cv.emit(
        "attention",
        [q, k, v],
        {
            "num_heads": int(qt.shape[1]),
            "num_kv_heads": int(kt.shape[1]),
            "head_dim": int(qt.shape[2]),
            "scale": float(scale),
            "causal": bool(causal),
            "sliding_window": int(window) or None,
            "softcap": float(softcap) or None,
            "layer": int(layer),
        },
    )


@lower(aten.scaled_dot_product_attention)
def _sdpa(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    """sdpa on [1, H, T, D] (a model that bypasses the attention interface) -> attention."""
    q, k, v = args[0], args[1], args[2]
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if mask is not None:
        raise UnsupportedOpError(
            f"scaled_dot_product_attention with an explicit mask at FX node {node.name} "
            f"(module {node.meta.get('nn_module_stack', {})}); portlayer expects masks to come from "
            "attention metadata. Load the model with attn_implementation='portlayer'."
        )
    causal = bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False))
    scale = kwargs.get("scale")
    qt, kt, vt = cv.type_of(q), cv.type_of(k), cv.type_of(v)
    if qt.rank != 4 or qt.shape[0] != 1:
        raise UnsupportedOpError(f"sdpa on {qt} at FX node {node.name}: want [1, heads, tokens, head_dim]")
    tok = qt.shape[2]

    def tm(x: str, t: Any) -> str:
        y = cv.emit("transpose", [x], {"dim0": 1, "dim1": 2}, name=f"{node.name}_tm")
        return cv.reshape_to(y, (tok, t.shape[1], t.shape[3]))

    import math

    out = cv.emit("attention", [tm(q, qt), tm(k, kt), tm(v, vt)], {
        "num_heads": int(qt.shape[1]), "num_kv_heads": int(kt.shape[1]), "head_dim": int(qt.shape[3]),
        "scale": float(scale) if scale is not None else 1.0 / math.sqrt(int(qt.shape[3])),
        "causal": causal, "layer": 0,
    })
    out = cv.reshape_to(out, (1, tok, qt.shape[1], vt.shape[3]))
    return cv.emit("transpose", [out], {"dim0": 1, "dim1": 2}, name=f"{node.name}_hm")
