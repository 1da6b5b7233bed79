"""The portable op registry: every Flat IR op is defined here exactly once.

An op definition carries its signature (input names, attribute defaults), shape/dtype
inference over symbolic dims, a reference torch implementation (the semantics every
backend must reproduce) and a cost model (FLOPs, bytes). Definitions live in
``flatten/op_defs/`` and fill the registry through the ``@op`` decorator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from portlayer.flatten.ir import Dim, Graph, TensorType, dtype_itemsize, eval_dim, normalize_dim

InferFn = Callable[[list[TensorType | None], dict[str, Any]], list[TensorType]]
RefFn = Callable[..., Any]
FlopsFn = Callable[[list[TensorType | None], list[TensorType], dict[str, Any], Mapping[str, int]], int]

#: op kinds steer fusion and codegen: pointwise ops fuse into chains, reductions take a
#: prologue/epilogue, views cost no bytes, "sequence" ops see sequence boundaries.
KINDS = ("pointwise", "reduction", "gemm", "attention", "view", "data", "sequence", "creation")


@dataclass(frozen=True)
class Cost:
    flops: int = 0
    bytes: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)


@dataclass(frozen=True)
class OpDef:
    """One portable op. ``inputs`` names end in '?' when optional."""

    name: str
    kind: str
    inputs: tuple[str, ...]
    attrs: Mapping[str, Any]
    infer_fn: InferFn
    ref_fn: RefFn
    flops_fn: FlopsFn | None = None
    needs_context: bool = False
    doc: str = ""
    num_outputs: int = 1
    variadic: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    def complete_attrs(self, attrs: dict[str, Any]) -> dict[str, Any]:
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise ValueError(
                f"op {self.name!r} got unknown attributes {sorted(unknown)}; it accepts {sorted(self.attrs)}"
            )
        out = dict(self.attrs)
        out.update(attrs)
        return out

    def infer(self, in_types: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
        self._check_arity(in_types)
        return self.infer_fn(list(in_types), attrs)

    def reference(
        self, inputs: Sequence[torch.Tensor | None], attrs: Mapping[str, Any], ctx: Any = None
    ) -> list[torch.Tensor]:
        """Run the op's semantics with torch; always returns a list of outputs."""
        kwargs = dict(attrs)
        if self.needs_context:
            kwargs["ctx"] = ctx
        out = self.ref_fn(*inputs, **kwargs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def cost(
        self,
        in_types: Sequence[TensorType | None],
        out_types: Sequence[TensorType],
        attrs: Mapping[str, Any],
        bindings: Mapping[str, int],
    ) -> Cost:
        flops = self.flops_fn(list(in_types), list(out_types), dict(attrs), bindings) if self.flops_fn else 0
        if self.kind == "view":
            return Cost(flops, 0)
        moved = sum(t.nbytes(bindings) for t in in_types if t is not None)
        moved += sum(t.nbytes(bindings) for t in out_types)
        return Cost(flops, moved)

    def _check_arity(self, in_types: Sequence[Any]) -> None:
        if self.variadic:
            return
        required = sum(1 for i in self.inputs if not i.endswith("?"))
        if not (required <= len(in_types) <= len(self.inputs)):
            raise ValueError(
                f"op {self.name!r} takes inputs {list(self.inputs)} but got {len(in_types)} inputs"
            )
        for i, (nm, t) in enumerate(zip(self.inputs, in_types)):
            if t is None and not nm.endswith("?"):
                raise ValueError(f"op {self.name!r}: required input {i} ({nm}) is missing")


_REGISTRY: dict[str, OpDef] = {}


def op(
    name: str,
    *,
    kind: str,
    inputs: Sequence[str],
    attrs: Mapping[str, Any] | None = None,
    infer: InferFn,
    flops: FlopsFn | None = None,
    needs_context: bool = False,
    num_outputs: int = 1,
    variadic: bool = False,
    **extra: Any,
) -> Callable[[RefFn], RefFn]:
    """Decorator registering ``fn`` as the reference implementation of op ``name``."""
    if kind not in KINDS:
        raise ValueError(f"op {name!r}: kind {kind!r} is not one of {KINDS}")

    def deco(fn: RefFn) -> RefFn:
        if name in _REGISTRY:
            raise ValueError(f"op {name!r} is registered twice ({_REGISTRY[name].ref_fn.__module__} and {fn.__module__})")
        _REGISTRY[name] = OpDef(
            name=name,
            kind=kind,
            inputs=tuple(inputs),
            attrs=dict(attrs or {}),
            infer_fn=infer,
            ref_fn=fn,
            flops_fn=flops,
            needs_context=needs_context,
            doc=(fn.__doc__ or "").strip(),
            num_outputs=num_outputs,
            variadic=variadic,
            extra=extra,
        )
        return fn

    return deco


def get_op(name: str) -> OpDef:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"op {name!r} is not in the portable op registry (flatten/op_defs/); known ops: {sorted(_REGISTRY)}"
        ) from None


def all_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)


# ---- shape helpers shared by op definitions --------------------------------------------


def _dims_equal(a: Dim, b: Dim) -> bool:
    return normalize_dim(a) == normalize_dim(b)


def broadcast_shapes(*shapes: Sequence[Dim]) -> tuple[Dim, ...]:
    """numpy broadcasting over symbolic dims: 1 stretches; equal symbols match."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for i in range(rank):
        dim: Dim = 1
        for s in shapes:
            j = i - (rank - len(s))
            if j < 0:
                continue
            d = s[j]
            if dim == 1:
                dim = d
            elif d == 1 or _dims_equal(d, dim):
                continue
            else:
                raise ValueError(f"shapes {[list(s) for s in shapes]} do not broadcast at dim {i}: {dim} vs {d}")
        out.append(dim)
    return tuple(out)


def norm_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ValueError(f"axis {axis} out of range for rank {rank}")
    return axis % max(rank, 1)


def numel(t: TensorType, bindings: Mapping[str, int]) -> int:
    return t.numel(bindings)


def out_numel_flops(per_elem: int = 1) -> FlopsFn:
    def f(ins: list[TensorType | None], outs: list[TensorType], attrs: dict[str, Any], b: Mapping[str, int]) -> int:
        return per_elem * sum(o.numel(b) for o in outs)

    return f


def graph_cost(graph: Graph, bindings: Mapping[str, int] | None = None) -> Cost:
    """Total FLOPs and bytes moved by one execution of ``graph`` under ``bindings``.

    Parameters count as bytes moved once per use, which is the memory-bound view a
    decode step has; ``bindings`` defaults to one token.
    """
    b = dict(bindings or {"num_tokens": 1})
    b.setdefault("num_seqs", 1)
    types = graph.value_types()
    total = Cost()
    for n in graph.nodes:
        d = get_op(n.op)
        ins = [types[i] if i is not None else None for i in n.inputs]
        total = total + d.cost(ins, [v.type for v in n.outputs], n.attrs, b)
    return total


def node_cost(graph: Graph, node_name: str, bindings: Mapping[str, int] | None = None) -> Cost:
    types = graph.value_types()
    n = graph.node(node_name)
    ins = [types[i] if i is not None else None for i in n.inputs]
    b = dict(bindings or {"num_tokens": 1})
    b.setdefault("num_seqs", 1)
    return get_op(n.op).cost(ins, [v.type for v in n.outputs], n.attrs, b)


def itemsize(t: TensorType) -> int:
    return dtype_itemsize(t.dtype)


def concrete(d: Dim, bindings: Mapping[str, int]) -> int:
    return eval_dim(d, bindings)


# Fill the registry.
from portlayer.flatten.op_defs import attention as _attention  # noqa: E402,F401
from portlayer.flatten.op_defs import collective as _collective  # noqa: E402,F401
from portlayer.flatten.op_defs import elementwise as _elementwise  # noqa: E402,F401
from portlayer.flatten.op_defs import layout as _layout  # noqa: E402,F401
from portlayer.flatten.op_defs import mla as _mla  # noqa: E402,F401
from portlayer.flatten.op_defs import moe as _moe  # noqa: E402,F401
from portlayer.flatten.op_defs import nn as _nn  # noqa: E402,F401
from portlayer.flatten.op_defs import quant as _quant  # noqa: E402,F401
from portlayer.flatten.op_defs import rope as _rope  # noqa: E402,F401
