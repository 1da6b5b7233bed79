"""Mixture-of-experts ops: the routed experts as one op, and the selection ops routers use.

A router (softmax or sigmoid scoring, score-correction bias, group-limited selection, top-k,
normalisation, routed scaling) is captured from the model's own code as ordinary ops plus
``topk`` and ``scatter``, so every routing variant is reproduced exactly as written. What
follows the router is always the same computation and is the expensive part:
``moe_experts`` takes each token's chosen expert ids and weights and runs the gated expert
MLPs with the weighted combine (vLLM's ``fused_experts(hidden, w1, w2, topk_weights,
topk_ids)`` contract). Shared experts stay ordinary linears.
"""

from __future__ import annotations

from typing import Any

import torch

from portlayer.flatten.ir import TensorType, eval_dim
from portlayer.flatten.ops import op

ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}


def _moe_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    x, ids, w, gu, down = ins
    if x.rank != 2 or ids.rank != 2 or w.rank != 2 or gu.rank != 3 or down.rank != 3:
        raise ValueError(f"moe_experts wants x [T, H], ids/weights [T, k], gate_up [E, 2I, H], down [E, H, I]; "
                         f"got {x}, {ids}, {w}, {gu}, {down}")
    if ids.dtype not in ("int64", "int32"):
        raise ValueError(f"moe_experts: expert ids must be integers, got {ids}")
    return [x]


def _moe_flops(ins, outs, a, b) -> int:
    t = eval_dim(ins[0].shape[0], b)
    k, hidden, inter = int(ins[1].shape[1]), int(ins[0].shape[1]), int(ins[4].shape[2])
    return int(t * k * (6 * hidden * inter + 4 * inter + hidden))


@op(
    "moe_experts",
    kind="gemm",
    inputs=("x", "topk_ids", "topk_weights", "w_gate_up", "w_down"),
    attrs={"num_experts": 1, "top_k": 1, "intermediate_size": 1, "activation": "silu"},
    infer=_moe_infer,
    flops=_moe_flops,
)
def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    num_experts: int = 1,
    top_k: int = 1,
    intermediate_size: int = 1,
    activation: str = "silu",
) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * down[e] @ (act(gate[e] @ x[t]) * up[e] @ x[t]), e = ids[t, j].

    ``w_gate_up[e]`` holds the gate rows then the up rows ([2I, H], HF's concatenated layout).
    float32 accumulation; ids outside [0, num_experts) contribute nothing.
    """
    act = ACTIVATIONS[activation]
    inter = w_gate_up.shape[1] // 2
    per_slot = torch.zeros(x.shape[0], topk_ids.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        if not 0 <= e < w_gate_up.shape[0]:
            continue
        tok, slot = torch.where(topk_ids == e)
        h = x[tok].float() @ w_gate_up[e].float().t()
        y = (act(h[:, :inter]) * h[:, inter:]) @ w_down[e].float().t()
        per_slot[tok, slot] = y * topk_weights[tok, slot, None].float()
    return per_slot.sum(dim=1).to(x.dtype)  # a fixed summation order, whatever the routing


def _topk_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    x = ins[0]
    d = a["dim"] % x.rank
    shape = tuple(int(a["k"]) if i == d else s for i, s in enumerate(x.shape))
    return [TensorType(x.dtype, shape), TensorType("int64", shape)]


@op("topk", kind="data", inputs=("x",), attrs={"k": 1, "dim": -1, "largest": True, "sorted": True},
    infer=_topk_infer, num_outputs=2)
def topk(x: torch.Tensor, k: int = 1, dim: int = -1, largest: bool = True, sorted: bool = True):  # noqa: A002
    """The k largest (or smallest) entries along ``dim`` and their indices (torch.topk)."""
    r = torch.topk(x, int(k), dim=dim, largest=largest, sorted=sorted)
    return [r.values, r.indices]


def _scatter_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    return [ins[0]]


@op("scatter", kind="data", inputs=("x", "index"), attrs={"dim": 0, "value": 0.0}, infer=_scatter_infer)
def scatter(x: torch.Tensor, index: torch.Tensor, dim: int = 0, value: float = 0.0) -> torch.Tensor:
    """A copy of x with ``value`` written at ``index`` along ``dim`` (torch.scatter, value form)."""
    return x.scatter(dim, index.long(), value)
