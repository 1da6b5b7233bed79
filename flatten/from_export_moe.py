"""The aten -> portable op table, part 3: mixture-of-experts (the experts hook's op) and the
selection ops routers are written with (topk, scatter)."""

from __future__ import annotations

import torch

from portlayer.flatten import hf_moe  # noqa: F401  (defines torch.ops.portlayer.moe_experts)
from portlayer.flatten.from_export import Converter, UnsupportedOpError, lower
from portlayer.flatten.from_export_table import _is_tensor

aten = torch.ops.aten
Node = torch.fx.Node


@lower(torch.ops.portlayer.moe_experts)
def _moe_experts(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    x, ids, weights, gate_up, down, activation = args
    gu, dn = cv.type_of(gate_up), cv.type_of(down)
    return cv.emit("moe_experts", [x, ids, weights, gate_up, down], {
        "num_experts": int(gu.shape[0]), "top_k": int(cv.type_of(ids).shape[1]),
        "intermediate_size": int(dn.shape[2]), "activation": str(activation)})


@lower(aten.topk)
def _topk(cv: Converter, node: Node, args: list, kwargs: dict) -> list[str]:
    x, k = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
    ordered = args[4] if len(args) > 4 else kwargs.get("sorted", True)
    if not isinstance(k, int):
        raise UnsupportedOpError(f"topk with a symbolic k at FX node {node.name}")
    return cv.emit_multi("topk", [x], {"k": k, "dim": int(dim), "largest": bool(largest), "sorted": bool(ordered)})


@lower(aten.scatter)
def _scatter(cv: Converter, node: Node, args: list, kwargs: dict) -> str:
    x, dim, index, src = args[0], args[1], args[2], args[3] if len(args) > 3 else kwargs.get("value")
    if _is_tensor(src) or kwargs.get("reduce") or len(args) > 4:
        raise UnsupportedOpError(f"scatter with a tensor source or a reduction at FX node {node.name}; "
                                 "only the value form (x.scatter(dim, index, value)) is supported")
    return cv.emit("scatter", [x, index], {"dim": int(dim), "value": float(src)})
