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


# ---- in-place ops converted directly (no re-trace) -------------------------------------------

_VIEWS = {aten.view, aten._unsafe_view, aten.slice, aten.select, aten.transpose, aten.permute, aten.expand,
          aten.unsqueeze, aten.squeeze, aten.t, aten.alias, aten.detach, aten.as_strided, aten.unflatten,
          aten.flatten, aten.view_as, aten.diagonal, aten.narrow, aten.split, aten.chunk, aten.unbind,
          aten.split_with_sizes, aten.expand_as, aten.reshape, aten.unfold, aten.movedim, aten.swapaxes}


def _packet(n: Node) -> object:
    return getattr(n.target, "overloadpacket", None)


def _is_view(n: Node) -> bool:
    return n.op == "call_function" and _packet(n) in _VIEWS


def mutates(n: Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return n.op == "call_function" and schema is not None and schema.is_mutable


def _functional(n: Node) -> object | None:
    name = n.target._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    return getattr(packet, n.target._overloadname, None) if packet is not None else None


def _is_copy_into(user: Node, view: Node) -> bool:
    return _packet(user) is aten.copy_ and user.args[0] is view


def directly_convertible(graph: torch.fx.Graph) -> bool:
    """Every mutation writes a fresh tensor (or one slice/select of one) that no earlier view
    still reads: then value-level conversion is exact. Anything else goes through
    torch.export's functionalization instead (from_export.functionalized)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for m in graph.nodes:
        if not mutates(m):
            continue
        t = m.args[0] if m.args else None
        if not isinstance(t, Node) or _functional(m) is None:
            return False
        if _is_view(t):
            if _packet(t) not in (aten.slice, aten.select) or list(t.users) != [m]:
                return False
            base = t.args[0]
        else:
            base = t
        if not isinstance(base, Node) or base.op != "call_function" or _is_view(base):
            return False  # a graph input, a parameter or a view chain
        for v in base.users:
            if v in (t, m) or not _is_view(v) or order[v] > order[m]:
                continue
            if len(v.users) == 1 and _is_copy_into(next(iter(v.users)), v):
                continue  # a slice that is only ever overwritten
            return False
    return True


def convert_mutation(cv: Converter, node: Node) -> str:
    """Convert ``x.op_(...)`` as ``op(...)``; later readers of x (or of the base x is a slice
    of) see the new value. Only called when directly_convertible() held for the graph."""
    t = node.args[0]
    original = node.target
    node.target = _functional(node)
    try:
        out = cv._call(node)
    finally:
        node.target = original
    if not _is_view(t):
        cv.env[t.name] = out
        return out
    base = t.args[0]
    if _packet(t) is aten.slice:
        start = _slice_bound(cv, cv._resolve(t.args[2])) if len(t.args) > 2 else 0
        end = _slice_bound(cv, cv._resolve(t.args[3])) if len(t.args) > 3 else None
        if (len(t.args) > 4 and t.args[4] != 1) or isinstance(start, str) or isinstance(end, str):
            raise UnsupportedOpError(f"in-place write into a strided or symbolic slice at FX node {node.name}")
        new = _scatter_along(cv, node, cv.env[base.name], out, int(t.args[1]), int(start or 0),
                             2**62 if end is None else int(end))
    else:
        dim, index = int(t.args[1]), int(t.args[2])
        shape = list(cv.type_of(cv.env[base.name]).shape)
        d = dim % len(shape)
        piece = cv.reshape_to(out, tuple(shape[:d] + [1] + shape[d + 1:]))
        new = _scatter_along(cv, node, cv.env[base.name], piece, d, index, index + 1 if index != -1 else 2**62)
    cv.env[base.name] = new
    return out
