"""Cumulative sum in portable ops, shared by the torch.export and ONNX importers: a matmul with a triangular
0/1 matrix built from arange. Integers are summed in float64 (exact below 2**53). Floats are summed in their own
dtype, with non-finite values taken out first: a 0 * inf in the matmul would turn every later element into nan.
Where a +inf / -inf / nan has been seen, the result is what a running sum gives (inf, -inf, or nan once nan or
both infinities have been seen). Floats are summed in the matmul's order, not left to right, so the result can
differ from a sequential sum in the last bits, and near the dtype's largest value a partial sum can overflow to inf
where torch's (float64-accumulating, on the CPU) does not. ``out_dtype`` (torch's ``dtype=``) is cast to first."""

from __future__ import annotations

from typing import Any

INTS = ("int64", "int32", "int16", "int8", "uint8", "bool")


def emit_cumsum(cv: Any, x: str, axis: int, exclusive: bool = False, reverse: bool = False,
                out_dtype: str | None = None) -> str:
    """x's cumulative sum along ``axis`` (``cv``: a converter with emit / type_of / reshape_to), in ``out_dtype``
    (default x's)."""
    t = cv.type_of(x)
    out_dtype = out_dtype or t.dtype
    if out_dtype != t.dtype:  # torch.cumsum(x, dtype=d) casts x to d, then sums (in d: fp16 into float32, floats to ints)
        x = cv.emit("cast", [x], {"dtype": out_dtype})
        t = cv.type_of(x)
    if t.rank == 0:  # the cumulative sum of one number is that number
        return x
    if t.rank == 1:  # as a row, then back
        y = emit_cumsum(cv, cv.reshape_to(x, [1, t.shape[0]]), 1, exclusive, reverse, out_dtype)
        return cv.reshape_to(y, list(t.shape))
    axis %= t.rank
    n = t.shape[axis]
    r = cv.emit("arange", [], {"start": 0, "end": n, "step": 1, "dtype": "int64"})
    rows, cols = cv.reshape_to(r, [n, 1]), cv.reshape_to(r, [1, n])
    cmp = {(False, False): "le", (True, False): "lt", (False, True): "ge", (True, True): "gt"}[(exclusive, reverse)]
    work = "float64" if t.dtype in INTS else t.dtype
    tri = cv.emit("cast", [cv.emit(cmp, [rows, cols])], {"dtype": work})
    perm = [i for i in range(t.rank) if i != axis] + [axis]
    xt = cv.emit("permute", [x], {"dims": perm}) if axis != t.rank - 1 else x
    xw = cv.emit("cast", [xt], {"dtype": work}) if work != t.dtype else xt
    y = cv.emit("matmul", [xw, tri]) if t.dtype in INTS else _float_scan(cv, xw, tri, work)
    y = cv.emit("cast", [y], {"dtype": out_dtype}) if work != out_dtype else y
    if axis != t.rank - 1:
        y = cv.emit("permute", [y], {"dims": [perm.index(i) for i in range(t.rank)]})
    return y


def _float_scan(cv: Any, x: str, tri: str, dtype: str) -> str:
    """x @ tri for float x holding +-inf or nan: the finite values through the matmul, then each position that has
    seen a +inf, -inf or nan (counted by 0/1 matmuls: a sum of zeros and ones is > 0 exactly when one was seen,
    whatever the dtype rounds) set as a running sum would leave it."""
    def seen(mask: str) -> str:
        return cv.emit("gt", [cv.emit("matmul", [cv.emit("cast", [mask], {"dtype": dtype}), tri])], {"scalar": 0})

    finite = cv.emit("eq", [cv.emit("sub", [x, x])], {"scalar": 0})  # x - x is 0 unless x is +-inf or nan
    y = cv.emit("matmul", [cv.emit("where", [finite, x], {"y_scalar": 0.0}), tri])
    pos, neg = seen(cv.emit("eq", [x], {"scalar": float("inf")})), seen(cv.emit("eq", [x], {"scalar": float("-inf")}))
    nan = cv.emit("logical_or", [seen(cv.emit("ne", [x, x])), cv.emit("logical_and", [pos, neg])])
    y = cv.emit("where", [pos, None, y], {"x_scalar": float("inf")})
    y = cv.emit("where", [neg, None, y], {"x_scalar": float("-inf")})
    return cv.emit("where", [nan, None, y], {"x_scalar": float("nan")})
