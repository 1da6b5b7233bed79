"""The aten -> portable op table, part 4: what functionalized in-place writes become.

``key[..., :n].copy_(k_nope)`` on a fresh tensor (DeepSeek's MLA) reaches the table, after
torch.export's functionalization (from_export.functionalized), as ``copy`` (src broadcast
to the view) and ``slice_scatter`` / ``select_scatter`` (the view written back into its
base). A scatter along a static axis is the base's untouched slices concatenated around the
new piece, so no new op is needed and later passes see plain slices and a concat.
"""

from __future__ import annotations

import torch

from portlayer.flatten.from_export import Converter, UnsupportedOpError, lower
from portlayer.flatten.from_export_table import _slice_bound

aten = torch.ops.aten
Node = torch.fx.Node


@lower(aten.copy)
def _copy(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    dst, src = args[0], args[1]
    want, shape = cv.type_of(dst), cv.out_shape()
    if tuple(cv.type_of(src).shape) != tuple(shape):
        src = cv.emit("expand", [src], {"shape": list(shape)}, name=f"{node.name}_expand")
    if cv.type_of(src).dtype != want.dtype:
        src = cv.emit("cast", [src], {"dtype": want.dtype}, name=f"{node.name}_cast")
    return src


def _scatter_along(cv: Converter, node: Node, base: str, src: str, dim: int, start: int, end: int) -> str:
    shape = cv.type_of(base).shape
    d = dim % len(shape)
    size = shape[d]
    if not isinstance(size, int):
        raise UnsupportedOpError(f"{node.target} along the symbolic axis {d} at FX node {node.name} "
                                 f"(from HF module '{node.meta.get('nn_module_stack', {})}')")
    start, end = max(0, start if start >= 0 else start + size), min(size, end if end >= 0 else end + size)
    parts = []
    if start > 0:
        parts.append(cv.emit("slice", [base], {"dim": d, "start": 0, "end": start, "step": 1}, name=f"{node.name}_lo"))
    parts.append(src)
    if end < size:
        parts.append(cv.emit("slice", [base], {"dim": d, "start": end, "end": None, "step": 1}, name=f"{node.name}_hi"))
    if len(parts) == 1:
        return src
    return cv.emit("concat", parts, {"dim": d})


@lower(aten.slice_scatter)
def _slice_scatter(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    base, src = args[0], args[1]
    dim = int(args[2]) if len(args) > 2 else int(kwargs.get("dim", 0))
    start = _slice_bound(cv, args[3] if len(args) > 3 else kwargs.get("start"))
    end = _slice_bound(cv, args[4] if len(args) > 4 else kwargs.get("end"))
    step = int(args[5] if len(args) > 5 else kwargs.get("step", 1))
    if step != 1 or isinstance(start, str) or isinstance(end, str):
        raise UnsupportedOpError(f"slice_scatter with step {step} or symbolic bounds at FX node {node.name}")
    return _scatter_along(cv, node, base, src, dim, int(start or 0), 2**62 if end is None else int(end))


@lower(aten.select_scatter)
def _select_scatter(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    base, src, dim, index = args[0], args[1], int(args[2]), int(args[3])
    shape = list(cv.type_of(base).shape)
    d = dim % len(shape)
    piece = cv.reshape_to(src, tuple(shape[:d] + [1] + shape[d + 1:]))
    return _scatter_along(cv, node, base, piece, d, index, index + 1 if index != -1 else 2**62)
