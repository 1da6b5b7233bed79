"""Cumulative sum in portable ops, shared by the torch.export and ONNX importers: a matmul with a triangular
0/1 matrix built from arange (exact for integers below 2**53: integer inputs are summed in float64)."""

from __future__ import annotations

from typing import Any

INTS = ("int64", "int32", "int16", "int8", "uint8", "bool")


def emit_cumsum(cv: Any, x: str, axis: int, exclusive: bool = False, reverse: bool = False,
                out_dtype: str | None = None) -> str:
    """x's cumulative sum along ``axis`` (``cv``: a converter with emit / type_of / reshape_to), in ``out_dtype``
    (default x's)."""
    t = cv.type_of(x)
    out_dtype = out_dtype or t.dtype
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
    y = cv.emit("matmul", [xw, tri])
    y = cv.emit("cast", [y], {"dtype": out_dtype}) if work != out_dtype else y
    if axis != t.rank - 1:
        y = cv.emit("permute", [y], {"dims": [perm.index(i) for i in range(t.rank)]})
    return y
