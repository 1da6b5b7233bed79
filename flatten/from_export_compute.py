"""The aten -> portable op table, part 2: arithmetic, reductions and normalisation, GEMMs, attention.

Part 1 (from_export_table.py) holds bookkeeping, dtype conversion, layout and creation.
"""

from __future__ import annotations

from typing import Any

import torch

from portlayer.flatten.from_export import Converter, UnsupportedOpError, lower
from portlayer.flatten.from_export_table import _is_tensor, _scalar
from portlayer.flatten.ir import dtype_name

aten = torch.ops.aten
Node = torch.fx.Node


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


@lower(aten.__and__, aten.__or__)
def _bool_and_or(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    """``a & b`` / ``a | b`` of bool tensors (transformers' mask functions combine masks so); on integers they are
    bitwise, which the portable ops do not have."""
    a, b = args[0], args[1]
    name = "logical_and" if node.target.overloadpacket is aten.__and__ else "logical_or"
    if not (_is_tensor(a) and _is_tensor(b)) or {cv.type_of(a).dtype, cv.type_of(b).dtype} != {"bool"}:
        raise UnsupportedOpError(f"bitwise {node.target.overloadpacket.__name__} of non-bool operands at FX node {node.name}")
    return cv.emit(name, [a, b])


@lower(aten.rsub)
def _rsub(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    a, b = args[0], args[1]
    alpha = kwargs.get("alpha", 1)
    if alpha != 1:
        a = cv.emit("mul", [a], {"scalar": alpha}, name=f"{node.name}_alpha")
    if _is_tensor(b):
        return cv.emit("sub", [b, a])
    return cv.emit("sub", [a], {"scalar": _scalar(b), "reverse": True})


@lower(aten.diff)
def _diff(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    """torch.diff: x[1:] - x[:-1] along ``dim``, ``n`` times, after prepend/append (bool: x[1:] != x[:-1]).
    transformers' mask code takes it of position ids to find packed sequences."""
    x = args[0]
    n = int(args[1]) if len(args) > 1 else int(kwargs.get("n", 1))
    dim = int(args[2]) if len(args) > 2 else int(kwargs.get("dim", -1))
    prepend = args[3] if len(args) > 3 else kwargs.get("prepend")
    append = args[4] if len(args) > 4 else kwargs.get("append")
    d = dim % cv.type_of(x).rank
    parts = [p for p in (prepend, x, append) if p is not None]
    if any(not _is_tensor(p) for p in parts):
        raise UnsupportedOpError(f"diff with a scalar prepend/append at FX node {node.name}")
    if len(parts) > 1:
        x = cv.emit("concat", parts, {"dim": d}, name=f"{node.name}_ends")
    op = "ne" if cv.type_of(x).dtype == "bool" else "sub"
    for i in range(n):
        hi = cv.emit("slice", [x], {"dim": d, "start": 1, "end": None, "step": 1}, name=f"{node.name}_hi{i}")
        lo = cv.emit("slice", [x], {"dim": d, "start": 0, "end": -1, "step": 1}, name=f"{node.name}_lo{i}")
        x = cv.emit(op, [hi, lo], name=f"{node.name}_{i}" if i < n - 1 else None)
    return x


@lower(aten.cumsum)
def _cumsum(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    """torch.cumsum (flatten/cumsum.py: a triangular matmul; integers exact below 2**53, floats with their infinities
    and nans as a running sum leaves them); transformers' mask code sums packed-sequence starts."""
    from portlayer.flatten.cumsum import INTS, emit_cumsum

    dim = int(args[1]) if len(args) > 1 else int(kwargs["dim"])
    dtype = cv.type_of(args[0]).dtype
    if dtype not in INTS and dtype not in ("float64", "float32", "float16", "bfloat16"):
        raise UnsupportedOpError(f"cumsum of {dtype} at FX node {node.name}: portlayer sums integers, bools and "
                                 "real floats")
    return emit_cumsum(cv, args[0], dim, out_dtype=cv.out_dtype())


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
    """x @ w (+ bias): a parameter ``w`` [K, N] becomes linear with a transposed [N, K] param, and the transpose
    of an [N, K] parameter (x @ W.T) linear with the parameter itself."""
    if w in cv.transposes:
        out = cv.emit("linear", [x, cv.transposes[w], bias])
    elif cv.is_param(w) and cv.type_of(w).rank == 2:
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
