"""The ONNX op -> portable op table, shape and layout half: Shape arithmetic, Reshape, Slice, Gather ...

Exporters compute shapes at run time (Shape -> Gather -> Concat -> Reshape). Those int64
vectors are carried as :class:`SymInts` of symbolic dims and folded here, so a Reshape lands as
``reshape(shape=['batch', 'seq', 12, 32])`` exactly like the aten path's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from portlayer.flatten.ir import Dim, normalize_dim, to_sympy
from portlayer.flatten.onnx_import import ONNX_DTYPES, OnnxConverter, SymInts, onnx_op
from portlayer.flatten.ops import broadcast_shapes

BIG = 2**62


def _dims(cv: OnnxConverter, v: Any) -> list[Dim]:
    """An int vector input (constant or SymInts) as a list of dims."""
    if isinstance(v, SymInts):
        return list(v.dims)
    if isinstance(v, np.ndarray):
        return [int(x) for x in v.reshape(-1)]
    raise cv.fail("a shape / index operand computed from tensor data at run time (only shape arithmetic is folded)")


def _sym(d: Any) -> Any:
    return to_sympy(d)


def _combine(op_type: str, x: Dim, y: Dim) -> Dim:
    import sympy

    a, b = _sym(x), _sym(y)
    if op_type == "Add":
        r = a + b
    elif op_type == "Sub":
        r = a - b
    elif op_type == "Mul":
        r = a * b
    elif op_type == "Div":
        r = sympy.floor(a / b)
    elif op_type == "Max":
        r = sympy.Max(a, b)
    elif op_type == "Min":
        r = sympy.Min(a, b)
    else:
        raise ValueError(op_type)
    return normalize_dim(r)


def _compare(op_type: str, x: Dim, y: Dim) -> bool | None:
    """Equal / Less ... on dims: decided when the difference is a constant or a size symbol is compared with <= 0."""
    d = _sym(x) - _sym(y)
    if d.is_number:
        d = int(d)
        return {"Equal": d == 0, "Less": d < 0, "LessOrEqual": d <= 0, "Greater": d > 0, "GreaterOrEqual": d >= 0}[op_type]
    if op_type == "Equal" and (d.is_positive or d.is_negative):  # symbols are positive sizes
        return False
    return None


def sym_binary(cv: OnnxConverter, op_type: str, a: Any, b: Any) -> Any:
    """Elementwise integer arithmetic / comparison / Where on shape vectors."""
    if op_type == "Where":
        x, y = b
        cond = a
        if not isinstance(cond, np.ndarray):
            raise cv.fail("Where on a shape vector with a run-time condition")
        xs, ys = _dims(cv, x), _dims(cv, y)
        n = max(cond.size, len(xs), len(ys))
        c = np.broadcast_to(cond.reshape(-1), (n,))
        xs, ys = xs * n if len(xs) == 1 else xs, ys * n if len(ys) == 1 else ys
        scalar = all((isinstance(v, SymInts) and v.scalar) or (isinstance(v, np.ndarray) and v.ndim == 0) for v in (x, y))
        return SymInts(tuple(xs[i] if c[i] else ys[i] for i in range(n)), scalar)
    if isinstance(a, str) or isinstance(b, str):
        return None  # mixed with run-time data: the caller computes it as tensors
    xs, ys = _dims(cv, a), _dims(cv, b)
    scalar = all((isinstance(v, SymInts) and v.scalar) or (isinstance(v, np.ndarray) and v.ndim == 0) for v in (a, b))
    n = max(len(xs), len(ys))
    xs, ys = xs * n if len(xs) == 1 else xs, ys * n if len(ys) == 1 else ys
    if op_type in ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"):
        res = [_compare(op_type, p, q) for p, q in zip(xs, ys)]
        if any(r is None for r in res):
            raise cv.fail(f"{op_type} of symbolic dims {xs} and {ys} is not decidable at import")
        out = np.array(res, dtype=bool)
        return out.reshape(()) if scalar else out
    return _simplify(SymInts(tuple(_combine(op_type, p, q) for p, q in zip(xs, ys)), scalar))


def _simplify(s: SymInts) -> Any:
    c = s.const()
    return c if c is not None else s


@onnx_op("Shape")
def _shape(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    shape = list(cv.type_of(cv.tensor(ins[0])).shape)
    r = len(shape)
    start = int(attrs.get("start", 0))
    end = int(attrs.get("end", r))
    start, end = max(0, start + r if start < 0 else start), min(r, end + r if end < 0 else end)
    return [_simplify(SymInts(tuple(shape[start:end])))]


@onnx_op("Size")
def _size(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    t = cv.type_of(cv.tensor(ins[0]))
    n = _sym(1)
    for d in t.shape:
        n = n * _sym(d)
    return [_simplify(SymInts((normalize_dim(n),), scalar=True))]


def _vector_op(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> Any:
    """Gather / Slice / Concat / Unsqueeze / Squeeze / Reshape / Expand on shape vectors."""
    t = node.op_type
    x = ins[0]
    if t in ("Unsqueeze", "Reshape", "Expand", "Flatten") and isinstance(x, SymInts):
        return SymInts(x.dims, scalar=False)
    if t == "Squeeze" and isinstance(x, SymInts):
        return SymInts(x.dims, scalar=len(x.dims) == 1)
    if t == "Gather" and isinstance(x, SymInts):
        idx = ins[1]
        if not isinstance(idx, np.ndarray):
            raise cv.fail("Gather from a shape vector with run-time indices")
        n = len(x.dims)
        picked = tuple(x.dims[int(i) % n] for i in idx.reshape(-1))
        return _simplify(SymInts(picked, scalar=idx.ndim == 0))
    if t == "Slice" and isinstance(x, SymInts):
        st, en = _dims(cv, ins[1]), _dims(cv, ins[2])
        step = _dims(cv, ins[4])[0] if len(ins) > 4 and ins[4] is not None else 1
        if not all(isinstance(v, int) for v in st + en + [step]):
            raise cv.fail("Slice of a shape vector with symbolic bounds")
        return _simplify(SymInts(tuple(x.dims[slice(st[0], min(en[0], BIG), step)])))
    return None


@onnx_op("Concat")
def _concat(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    axis = int(attrs["axis"])
    if any(isinstance(v, SymInts) for v in ins):
        dims: list[Dim] = []
        for v in ins:
            dims += _dims(cv, v)
        return [_simplify(SymInts(tuple(dims)))]
    xs = [cv.tensor(v) for v in ins if v is not None]
    xs = [x for x in xs if cv.type_of(x).shape[axis % cv.type_of(x).rank] != 0] or xs[:1]
    if len(xs) == 1:
        return [xs[0]]
    return [cv.emit("concat", xs, {"dim": axis % cv.type_of(xs[0]).rank})]


def _resolve_reshape(cv: OnnxConverter, src: list[Dim], tgt: list[Dim], allowzero: bool) -> list[Dim]:
    out = [src[i] if (d == 0 and not allowzero and i < len(src)) else d for i, d in enumerate(tgt)]
    if out.count(-1) > 1:
        raise cv.fail(f"Reshape target {tgt} has more than one -1")
    if -1 in out:
        total = _sym(1)
        for d in src:
            total = total * _sym(d)
        known = _sym(1)
        for d in out:
            if d != -1:
                known = known * _sym(d)
        out[out.index(-1)] = normalize_dim(total / known)
    return out


@onnx_op("Reshape")
def _reshape(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    if (v := _vector_op(cv, node, ins, attrs)) is not None:
        return [v]
    x = cv.tensor(ins[0])
    tgt = _resolve_reshape(cv, list(cv.type_of(x).shape), _dims(cv, ins[1]), bool(attrs.get("allowzero", 0)))
    return [cv.reshape_to(x, tgt)]


def _axes(cv: OnnxConverter, ins: list[Any], attrs: dict[str, Any]) -> list[int] | None:
    if len(ins) > 1 and ins[1] is not None:
        if not isinstance(ins[1], np.ndarray):
            raise cv.fail("axes computed at run time")
        return [int(a) for a in ins[1].reshape(-1)]
    return [int(a) for a in attrs["axes"]] if "axes" in attrs else None


@onnx_op("Unsqueeze")
def _unsqueeze(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    if (v := _vector_op(cv, node, ins, attrs)) is not None:
        return [v]
    x = cv.tensor(ins[0])
    shape = list(cv.type_of(x).shape)
    axes = _axes(cv, ins, attrs) or []
    r = len(shape) + len(axes)
    for a in sorted(a % r for a in axes):
        shape.insert(a, 1)
    return [cv.reshape_to(x, shape)]


@onnx_op("Squeeze")
def _squeeze(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    if (v := _vector_op(cv, node, ins, attrs)) is not None:
        return [v]
    x = cv.tensor(ins[0])
    shape = list(cv.type_of(x).shape)
    axes = _axes(cv, ins, attrs)
    drop = {a % len(shape) for a in axes} if axes is not None else {i for i, d in enumerate(shape) if d == 1}
    return [cv.reshape_to(x, [d for i, d in enumerate(shape) if i not in drop])]


@onnx_op("Flatten")
def _flatten(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    x = cv.tensor(ins[0])
    shape = list(cv.type_of(x).shape)
    axis = int(attrs.get("axis", 1))
    axis = axis + len(shape) if axis < 0 else axis
    a, b = _sym(1), _sym(1)
    for d in shape[:axis]:
        a = a * _sym(d)
    for d in shape[axis:]:
        b = b * _sym(d)
    return [cv.reshape_to(x, [normalize_dim(a), normalize_dim(b)])]


@onnx_op("Transpose")
def _transpose(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    x = cv.tensor(ins[0])
    r = cv.type_of(x).rank
    perm = [int(p) for p in attrs.get("perm", list(range(r))[::-1])]
    if perm == list(range(r)):
        return [x]
    return [cv.emit("permute", [x], {"dims": perm})]


@onnx_op("Slice")
def _slice(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    if (v := _vector_op(cv, node, ins, attrs)) is not None:
        return [v]
    x = cv.tensor(ins[0])
    shape = list(cv.type_of(x).shape)
    starts, ends = _dims(cv, ins[1]), _dims(cv, ins[2])
    axes = _dims(cv, ins[3]) if len(ins) > 3 and ins[3] is not None else list(range(len(starts)))
    steps = _dims(cv, ins[4]) if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    for st, en, ax, sp in zip(starts, ends, axes, steps):
        d = int(ax) % len(shape)
        if not isinstance(st, int) or not isinstance(sp, int) or sp <= 0:
            raise cv.fail(f"Slice with a symbolic start ({st}) or a non-positive step ({sp})")
        size = cv.type_of(x).shape[d]
        end: Dim | None = en
        if isinstance(en, int) and (en >= BIG or (isinstance(size, int) and en >= size)):
            end = None
        if isinstance(en, str) and en == size:
            end = None
        if st in (0,) and end is None and sp == 1:
            continue
        if isinstance(st, int) and isinstance(size, int) and st < 0:
            st = max(0, st + size)
        x = cv.emit("slice", [x], {"dim": d, "start": st, "end": end, "step": sp})
    return [x]


@onnx_op("Split")
def _split(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    x = cv.tensor(ins[0])
    shape = cv.type_of(x).shape
    axis = int(attrs.get("axis", 0)) % len(shape)
    n = len(node.output)
    if len(ins) > 1 and ins[1] is not None:
        sizes = _dims(cv, ins[1])
    elif "split" in attrs:
        sizes = [int(s) for s in attrs["split"]]
    else:
        total = shape[axis]
        if not isinstance(total, int):
            raise cv.fail("Split of a symbolic axis into equal parts")
        per = -(-total // n)
        sizes = [min(per, total - i * per) for i in range(n)]
    out, start = [], 0
    for s in sizes:
        if not isinstance(s, int):
            raise cv.fail("Split with symbolic piece sizes")
        out.append(cv.emit("slice", [x], {"dim": axis, "start": start, "end": start + s, "step": 1}))
        start += s
    return out


@onnx_op("Gather")
def _gather(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    """Gather(data, indices, axis): embedding for axis 0, index_select + reshape otherwise."""
    if (v := _vector_op(cv, node, ins, attrs)) is not None:
        return [v]
    data, idx = cv.tensor(ins[0]), ins[1]
    dshape = list(cv.type_of(data).shape)
    axis = int(attrs.get("axis", 0)) % len(dshape)
    if isinstance(idx, np.ndarray):
        if idx.ndim == 0 and isinstance(dshape[axis], int):
            i = int(idx) % dshape[axis]
            s = cv.emit("slice", [data], {"dim": axis, "start": i, "end": i + 1, "step": 1})
            return [cv.reshape_to(s, dshape[:axis] + dshape[axis + 1:])]
        if isinstance(dshape[axis], int):
            idx = np.where(idx < 0, idx + dshape[axis], idx)
    it = cv.tensor(idx)
    ishape = list(cv.type_of(it).shape)
    if axis == 0 and len(dshape) == 2 and cv.b.graph.params.get(data) is not None:
        return [cv.emit("embedding", [data, it])]  # a table lookup: token ids are never negative
    if isinstance(ins[1], str) and isinstance(dshape[axis], int):  # ONNX counts negative indices from the end
        neg = cv.emit("lt", [it], {"scalar": 0})
        it = cv.emit("where", [neg, cv.emit("add", [it], {"scalar": dshape[axis]}), it])
    flat = cv.reshape_to(it, [_numel(ishape)])
    sel = cv.emit("index_select", [data, flat], {"dim": axis})
    return [cv.reshape_to(sel, dshape[:axis] + ishape + dshape[axis + 1:])]


def _numel(shape: list[Dim]) -> Dim:
    n = _sym(1)
    for d in shape:
        n = n * _sym(d)
    return normalize_dim(n)


@onnx_op("GatherElements")
def _gather_elements(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    x, idx = cv.tensor(ins[0]), cv.tensor(ins[1])
    axis = int(attrs.get("axis", 0)) % cv.type_of(x).rank
    size = cv.type_of(x).shape[axis]
    if isinstance(size, int):  # ONNX counts negative indices from the end
        idx = cv.emit("where", [cv.emit("lt", [idx], {"scalar": 0}), cv.emit("add", [idx], {"scalar": size}), idx])
    return [cv.emit("gather", [x, idx], {"dim": axis})]


@onnx_op("Expand")
def _expand(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    if (v := _vector_op(cv, node, ins, attrs)) is not None:
        return [v]
    x = cv.tensor(ins[0])
    s = list(cv.type_of(x).shape)
    tgt = _dims(cv, ins[1])
    try:
        out = list(broadcast_shapes(s, tgt))
    except ValueError as e:
        raise cv.fail(str(e)) from None
    if len(out) > len(s):
        x = cv.reshape_to(x, [1] * (len(out) - len(s)) + s)
    if list(cv.type_of(x).shape) == out:
        return [x]
    return [cv.emit("expand", [x], {"shape": out})]


@onnx_op("ConstantOfShape")
def _constant_of_shape(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    from onnx import numpy_helper

    value = numpy_helper.to_array(attrs["value"]) if "value" in attrs else np.zeros(1, dtype=np.float32)
    dtype = {np.dtype(np.float32): "float32", np.dtype(np.int64): "int64", np.dtype(np.bool_): "bool",
             np.dtype(np.float16): "float16", np.dtype(np.int32): "int32", np.dtype(np.float64): "float64"}.get(value.dtype)
    if dtype is None:
        raise cv.fail(f"ConstantOfShape of dtype {value.dtype}")
    v = value.reshape(()).item()
    return [cv.emit("full", [], {"shape": _dims(cv, ins[0]), "value": v, "dtype": dtype})]


@onnx_op("Range")
def _range(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    start, limit, delta = (_dims(cv, v)[0] for v in ins)
    if not isinstance(start, int) or not isinstance(delta, int) or delta <= 0:
        raise cv.fail(f"Range with a symbolic start ({start}) or a non-positive step ({delta})")
    dtype = ins[0].dtype if isinstance(ins[0], np.ndarray) else np.dtype(np.int64)
    name = {np.dtype(np.int64): "int64", np.dtype(np.int32): "int32"}.get(np.dtype(dtype))
    if name is None:
        raise cv.fail(f"Range of dtype {dtype} with a symbolic limit")
    return [cv.emit("arange", [], {"start": start, "end": limit, "step": delta, "dtype": name})]


__all__ = ["ONNX_DTYPES", "sym_binary"]

