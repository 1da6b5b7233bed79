"""The aten -> portable op table used by from_export (one handler per aten op family)."""

from __future__ import annotations

import operator
from typing import Any

import torch

from portlayer.flatten.from_export import Converter, Sym, UnsupportedOpError, lower

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
    out = cv.emit("transpose", [args[0]], {"dim0": int(args[1]), "dim1": int(args[2])})
    if cv.is_param(args[0]) and cv.type_of(args[0]).rank == 2 and {int(args[1]) % 2, int(args[2]) % 2} == {0, 1}:
        cv.transposes[out] = args[0]
    return out


@lower(aten.t, aten.numpy_T)
def _t(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    rank = cv.type_of(args[0]).rank
    if rank < 2:
        return args[0]
    out = cv.emit("transpose", [args[0]], {"dim0": rank - 2, "dim1": rank - 1})
    if cv.is_param(args[0]) and rank == 2:
        cv.transposes[out] = args[0]  # x @ W.T (Falcon's FalconLinear) is linear(x, W): codegen/kernels/gemm.py's path
    return out


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
    if len(tensor_idx) == 1:
        d, idx = tensor_idx[0]
        out = cv.emit("index_select", [x, idx], {"dim": d})
        return cv.reshape_to(out, cv.out_shape())
    dims = [i for i, _ in tensor_idx]
    if not dims or dims != list(range(dims[0], dims[0] + len(dims))):
        raise UnsupportedOpError(f"advanced indexing with index tensors at non-adjacent dims {dims} at FX node "
                                 f"{node.name}; adjacent index tensors are supported")
    return _index_adjacent(cv, x, dims[0], [t for _, t in tensor_idx])


def _index_adjacent(cv: Converter, x: str, d0: int, idxs: list[str]) -> str:
    """x[..., i0, i1, ..., ik, ...] for index tensors at adjacent dims from d0 (transformers' mask functions index
    a [batch, tokens] tensor by two): the indices broadcast to one shape B and flattened to P = numel(B) positions,
    the first selects P slices along d0, each further one picks an element per position (gather), and the result
    takes B's shape in place of the indexed dims."""
    from portlayer.flatten.dims import canonical_dim

    xs, out, k = list(cv.type_of(x).shape), list(cv.out_shape()), len(idxs)
    bshape = out[d0:len(out) - (len(xs) - d0 - k)]
    p = canonical_dim("*".join(f"({d})" for d in bshape)) if bshape else 1
    flat = []
    for t in idxs:
        if tuple(cv.type_of(t).shape) != tuple(bshape):
            t = cv.emit("expand", [cv.reshape_to(t, [1] * (len(bshape) - cv.type_of(t).rank) + list(cv.type_of(t).shape))],
                        {"shape": bshape})
        flat.append(cv.reshape_to(t, [p]))
    y = cv.emit("index_select", [x, flat[0]], {"dim": d0})  # xs[:d0] + [P] + xs[d0 + 1:]
    for j in range(1, k):
        rest = xs[d0 + j + 1:]
        pick = cv.reshape_to(flat[j], [1] * d0 + [p, 1] + [1] * len(rest))
        pick = cv.emit("expand", [pick], {"shape": xs[:d0] + [p, 1] + rest})
        y = cv.reshape_to(cv.emit("gather", [y, pick], {"dim": d0 + 1}), xs[:d0] + [p] + rest)
    return cv.reshape_to(y, out)


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
