"""The ONNX op -> portable op table: arithmetic, activations, GEMMs, normalisations, reductions.

Shape and layout ops (Reshape, Shape, Slice, Gather, Concat ...) are in onnx_table_shape.py.
A handler gets the converter, the NodeProto, its inputs (Flat IR value names, numpy constants
or SymInts) and its attributes, and returns one entry per ONNX output.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from portlayer.flatten.onnx_import import ONNX_DTYPES, OnnxConverter, SymInts, onnx_op
from portlayer.flatten.onnx_table_shape import sym_binary

_INT_DTYPES = ("int64", "int32", "int16", "int8", "uint8")
_COMMUTATIVE = {"add", "mul", "eq", "logical_and", "logical_or"}
_MIRROR = {"lt": "gt", "gt": "lt", "le": "ge", "ge": "le"}  # c < x  is  x > c


def _scalar_for(c: np.ndarray, dtype: str) -> Any:
    """A size-1 constant as the Python scalar of the other operand's dtype."""
    v = c.reshape(()).item()
    if dtype == "bool":
        return bool(v)
    if dtype in _INT_DTYPES:
        return int(v)
    return float(v)


def _as_scalar(cv: OnnxConverter, c: Any, other: str) -> Any | None:
    if isinstance(c, np.ndarray) and c.size == 1 and c.ndim <= cv.type_of(other).rank:
        return _scalar_for(c, cv.type_of(other).dtype)
    return None


def _binary(op_type: str, op: str) -> None:
    @onnx_op(op_type)
    def h(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
        a, b = ins
        if (isinstance(a, SymInts) or isinstance(b, SymInts)) and (r := sym_binary(cv, op_type, a, b)) is not None:
            return [r]
        if isinstance(b, np.ndarray) and isinstance(a, str) and (s := _as_scalar(cv, b, a)) is not None:
            return [cv.emit(op, [a], {"scalar": s})]
        if isinstance(a, np.ndarray) and isinstance(b, str) and (s := _as_scalar(cv, a, b)) is not None:
            if op in _COMMUTATIVE:
                return [cv.emit(op, [b], {"scalar": s})]
            if op in _MIRROR:
                return [cv.emit(_MIRROR[op], [b], {"scalar": s})]
            return [cv.emit(op, [b], {"scalar": s, "reverse": True})]
        ta, tb = cv.tensor(a), cv.tensor(b)
        if op == "div" and cv.type_of(ta).dtype in _INT_DTYPES:
            raise cv.fail("integer Div of run-time tensors (ONNX truncates; the portable div is true division)")
        return [cv.emit(op, [ta, tb])]


for _t, _o in (("Add", "add"), ("Sub", "sub"), ("Mul", "mul"), ("Div", "div"), ("Pow", "pow"),
               ("Equal", "eq"), ("Less", "lt"), ("LessOrEqual", "le"), ("Greater", "gt"), ("GreaterOrEqual", "ge"),
               ("And", "logical_and"), ("Or", "logical_or")):
    _binary(_t, _o)


@onnx_op("Max", "Min")
def _max_min(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    op = "maximum" if node.op_type == "Max" else "minimum"
    acc = ins[0]
    for x in ins[1:]:
        if (isinstance(acc, SymInts) or isinstance(x, SymInts)) and (r := sym_binary(cv, node.op_type, acc, x)) is not None:
            acc = r
        elif isinstance(x, np.ndarray) and isinstance(acc, str) and (s := _as_scalar(cv, x, acc)) is not None:
            acc = cv.emit(op, [acc], {"scalar": s})
        elif isinstance(acc, np.ndarray) and isinstance(x, str) and (s := _as_scalar(cv, acc, x)) is not None:
            acc = cv.emit(op, [x], {"scalar": s})
        else:
            acc = cv.emit(op, [cv.tensor(acc), cv.tensor(x)])
    return [acc]


def _unary(op_type: str, op: str) -> None:
    @onnx_op(op_type)
    def h(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
        return [cv.emit(op, [cv.tensor(ins[0])])]


for _t, _o in (("Neg", "neg"), ("Abs", "abs"), ("Exp", "exp"), ("Log", "log"), ("Sqrt", "sqrt"), ("Tanh", "tanh"),
               ("Sigmoid", "sigmoid"), ("Relu", "relu"), ("Erf", "erf"), ("Cos", "cos"), ("Sin", "sin"),
               ("Not", "logical_not")):
    _unary(_t, _o)


@onnx_op("Reciprocal")
def _reciprocal(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    """1/sqrt(x) (how exporters write rsqrt) becomes rsqrt, so the rms_norm raiser sees the aten form."""
    x = cv.tensor(ins[0])
    prod = next((n for n in reversed(cv.b.graph.nodes) if n.outputs[0].name == x), None)
    if prod is not None and prod.op == "sqrt":
        return [cv.emit("rsqrt", [prod.inputs[0]])]
    return [cv.emit("reciprocal", [x])]


@onnx_op("IsNaN")
def _isnan(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    x = cv.tensor(ins[0])
    return [cv.emit("ne", [x, x])]


@onnx_op("Identity")
def _identity(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    return [ins[0]]


@onnx_op("Dropout")
def _dropout(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    """Inference: the identity (training_mode, when given, must be a constant False)."""
    if len(ins) > 2 and ins[2] is not None and not (isinstance(ins[2], np.ndarray) and not ins[2].any()):
        raise cv.fail("Dropout in training mode")
    if len(node.output) > 1 and node.output[1]:
        mask = cv.emit("full", [], {"shape": list(cv.type_of(cv.tensor(ins[0])).shape), "value": True, "dtype": "bool"})
        return [ins[0], mask]
    return [ins[0]]


@onnx_op("Gelu")
def _gelu(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    approx = attrs.get("approximate", b"none")
    approx = approx.decode() if isinstance(approx, bytes) else approx
    return [cv.emit("gelu", [cv.tensor(ins[0])], {"approximate": approx})]


@onnx_op("Cast", "CastLike")
def _cast(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    if node.op_type == "Cast":
        to = int(attrs["to"])
        if to not in ONNX_DTYPES:
            raise cv.fail(f"Cast to ONNX element type {to}, which the Flat IR cannot hold")
        dtype = ONNX_DTYPES[to]
    else:
        dtype = cv.type_of(cv.tensor(ins[1])).dtype
    if isinstance(ins[0], SymInts):
        if dtype not in _INT_DTYPES:
            raise cv.fail(f"a symbolic shape value cast to {dtype}")
        return [ins[0]]
    x = cv.tensor(ins[0])
    return [x if cv.type_of(x).dtype == dtype else cv.emit("cast", [x], {"dtype": dtype})]


@onnx_op("Softmax")
def _softmax(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    if cv.opset < 13:
        raise cv.fail("Softmax before opset 13 flattens its input (coerced 2-D); re-export with opset >= 13")
    return [cv.emit("softmax", [cv.tensor(ins[0])], {"dim": int(attrs.get("axis", -1))})]


@onnx_op("LayerNormalization")
def _layer_norm(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    """layer_norm over the last axis; normalising axes a.. flattens them into one last axis first."""
    x = cv.tensor(ins[0])
    shape = list(cv.type_of(x).shape)
    rank = len(shape)
    axis = int(attrs.get("axis", -1)) % rank
    eps = float(attrs.get("epsilon", 1e-5))
    tail = shape[axis:]
    if axis != rank - 1:
        if not all(isinstance(d, int) for d in tail):
            raise cv.fail(f"LayerNormalization over symbolic axes {tail}")
        x = cv.reshape_to(x, shape[:axis] + [int(np.prod(tail))])
    w = b = None
    for k in (1, 2):
        if len(ins) > k and ins[k] is not None:
            t = cv.tensor(ins[k].reshape(-1) if isinstance(ins[k], np.ndarray) else ins[k])
            if cv.type_of(t).rank != 1:
                t = cv.reshape_to(t, [int(np.prod(tail))])
            w, b = (t, b) if k == 1 else (w, t)
    y = cv.reshape_to(cv.emit("layer_norm", [x, w, b], {"eps": eps}), shape)
    outs: list[Any] = [y]
    if any(o for o in node.output[1:]):  # Mean and InvStdDev, shaped like x with the normalised axes as 1
        stat_shape = shape[:axis] + [1] * len(tail)
        mean = cv.emit("mean", [x], {"dims": [-1], "keepdim": True})
        dev = cv.emit("sub", [x, mean])
        var = cv.emit("mean", [cv.emit("mul", [dev, dev])], {"dims": [-1], "keepdim": True})
        inv = cv.emit("rsqrt", [cv.emit("add", [var], {"scalar": eps})])
        outs += [cv.reshape_to(mean, stat_shape), cv.reshape_to(inv, stat_shape)]
    return outs


@onnx_op("Sum")
def _sum(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    acc = cv.tensor(ins[0])
    for x in ins[1:]:
        acc = cv.emit("add", [acc, cv.tensor(x)])
    return [acc]


@onnx_op("MatMul")
def _matmul(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    """x @ W with a constant 2-D W becomes linear(x, W^T), the form every backend's GEMM takes."""
    a, b = ins
    if isinstance(a, str) and isinstance(b, np.ndarray) and b.ndim == 2 and cv.type_of(a).rank >= 1:
        w = cv.param(np.ascontiguousarray(b.T), f"{cv._const_names.get(id(b)) or node.name}_t")
        return [cv.emit("linear", [a, w, None])]
    x, y = cv.tensor(a), cv.tensor(b)
    xs, ys = list(cv.type_of(x).shape), list(cv.type_of(y).shape)
    if len(xs) >= 2 and len(ys) >= 2:
        return [cv.emit("matmul", [x, y])]
    # numpy's 1-D rules: a vector on the left is a row, on the right a column, and that axis is dropped
    x2 = cv.reshape_to(x, [1] + xs) if len(xs) == 1 else x
    y2 = cv.reshape_to(y, ys + [1]) if len(ys) == 1 else y
    z = cv.emit("matmul", [x2, y2])
    out = list(cv.type_of(z).shape)
    if len(ys) == 1:
        out = out[:-1]
    if len(xs) == 1:
        out = out[:-1] if len(ys) == 1 else out[:-2] + out[-1:]
    return [cv.reshape_to(z, out)]


@onnx_op("Gemm")
def _gemm(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    """alpha * A' @ B' + beta * C: linear when B is constant (C a constant bias), matmul otherwise."""
    a, b = ins[0], ins[1]
    c = ins[2] if len(ins) > 2 else None
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    x = cv.tensor(a)
    if attrs.get("transA", 0):
        x = cv.emit("transpose", [x], {"dim0": 0, "dim1": 1})
    bias = None
    if isinstance(b, np.ndarray):
        w = b if attrs.get("transB", 0) else b.T
        if isinstance(c, np.ndarray) and c.size in (1, w.shape[0]):
            bias = cv.param(np.broadcast_to(c.reshape(-1) * beta / alpha, (w.shape[0],)).astype(c.dtype), f"{node.name}_bias")
            c = None
        y = cv.emit("linear", [x, cv.param(np.ascontiguousarray(w), f"{node.name}_weight"), bias])
    else:
        yb = cv.tensor(b)
        if attrs.get("transB", 0):
            yb = cv.emit("transpose", [yb], {"dim0": 0, "dim1": 1})
        y = cv.emit("matmul", [x, yb])
    if alpha != 1.0:
        y = cv.emit("mul", [y], {"scalar": alpha})
    if c is not None:
        ct = cv.tensor(c)
        if beta != 1.0:
            ct = cv.emit("mul", [ct], {"scalar": beta})
        y = cv.emit("add", [y, ct])
    return [y]


def _reduce(op_type: str, op: str) -> None:
    @onnx_op(op_type)
    def h(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
        x = cv.tensor(ins[0])
        rank = cv.type_of(x).rank
        axes_in = ins[1] if len(ins) > 1 else None
        if axes_in is not None and not isinstance(axes_in, np.ndarray):
            raise cv.fail("reduction axes computed at run time")
        axes = [int(a) for a in (axes_in.reshape(-1) if axes_in is not None else attrs.get("axes", []))]
        if not axes:
            if attrs.get("noop_with_empty_axes", 0):
                return [x]
            axes = list(range(rank))
        dims = sorted(a % rank for a in axes)
        return [cv.emit(op, [x], {"dims": dims, "keepdim": bool(attrs.get("keepdims", 1))})]


for _t, _o in (("ReduceMean", "mean"), ("ReduceSum", "sum"), ("ReduceMax", "amax"), ("ReduceMin", "amin")):
    _reduce(_t, _o)


@onnx_op("Where")
def _where(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    cond, x, y = ins
    if any(isinstance(v, SymInts) for v in ins) and not any(isinstance(v, str) for v in ins):
        return [sym_binary(cv, "Where", cond, (x, y))]
    c = cv.tensor(cond)
    rank = cv.type_of(c).rank
    operands, scal = [], {}
    ref = x if isinstance(x, str) else y if isinstance(y, str) else None
    for key, v in (("x", x), ("y", y)):
        if isinstance(v, np.ndarray) and v.size == 1 and v.ndim <= rank and ref is not None:
            scal[f"{key}_scalar"] = _scalar_for(v, cv.type_of(ref).dtype)
            operands.append(None)
        else:
            operands.append(cv.tensor(v))
    return [cv.emit("where", [c, *operands], scal)]


@onnx_op("Constant")
def _constant(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    from portlayer.flatten.onnx_import import fold_constant

    return fold_constant(node, [], cv.opset)
