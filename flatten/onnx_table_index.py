"""The ONNX op -> portable op table, indexing half: GatherND and CumSum, built from portable ops.

Neither has a portable op of its own: GatherND is one row lookup into the data flattened over its
indexed axes, CumSum a matmul with a triangular 0/1 matrix built from arange.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from portlayer.flatten.ir import Dim, normalize_dim
from portlayer.flatten.onnx_import import OnnxConverter, SymInts, onnx_op
from portlayer.flatten.onnx_table_shape import _numel, _sym


def _dim_tensor(cv: OnnxConverter, d: Dim) -> tuple[str | None, int | None]:
    """A dim as a scalar attribute (int) or a run-time [1] int64 tensor (symbolic)."""
    if isinstance(d, int):
        return None, d
    return cv.tensor(SymInts((d,))), None


@onnx_op("GatherND")
def _gather_nd(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    """data[idx[..., 0], ..., idx[..., k-1]] as one row lookup into data flattened over its first k axes."""
    if int(attrs.get("batch_dims", 0)) != 0:
        raise cv.fail("GatherND with batch_dims > 0")
    data, idx = cv.tensor(ins[0]), cv.tensor(ins[1])
    ds, ishape = list(cv.type_of(data).shape), list(cv.type_of(idx).shape)
    k = ishape[-1]
    if not isinstance(k, int) or k > len(ds):
        raise cv.fail(f"GatherND with index depth {k}")
    flat = None
    for j in range(k):
        part = cv.emit("slice", [idx], {"dim": len(ishape) - 1, "start": j, "end": j + 1, "step": 1})
        stride = _sym(1)
        for d in ds[j + 1:k]:
            stride = stride * _sym(d)
        t, s = _dim_tensor(cv, normalize_dim(stride))
        if s is None:
            part = cv.emit("mul", [part, t])
        elif s != 1:
            part = cv.emit("mul", [part], {"scalar": s})
        flat = part if flat is None else cv.emit("add", [flat, part])
    rows = cv.reshape_to(data, [_numel(ds[:k])] + ds[k:])
    sel = cv.emit("index_select", [rows, cv.reshape_to(flat, [_numel(ishape[:-1])])], {"dim": 0})
    return [cv.reshape_to(sel, ishape[:-1] + ds[k:])]


@onnx_op("CumSum")
def _cumsum(cv: OnnxConverter, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    """Cumulative sum as a matmul with a triangular 0/1 matrix (flatten/cumsum.py)."""
    from portlayer.flatten.cumsum import emit_cumsum

    if not isinstance(ins[1], np.ndarray):
        raise cv.fail("CumSum with a run-time axis")
    return [emit_cumsum(cv, cv.tensor(ins[0]), int(ins[1].reshape(())), bool(attrs.get("exclusive", 0)),
                        bool(attrs.get("reverse", 0)))]
