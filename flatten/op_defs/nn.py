"""Neural-network ops: embedding, linear/matmul, normalisations, softmax, reductions, pooling."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from portlayer.flatten.ir import TensorType, dtype_name, torch_dtype
from portlayer.flatten.ops import broadcast_shapes, norm_axis, op, out_numel_flops


def _promote(*dtypes: str) -> str:
    out = torch_dtype(dtypes[0])
    for d in dtypes[1:]:
        out = torch.promote_types(out, torch_dtype(d))
    return dtype_name(out)


@op("embedding", kind="data", inputs=("weight", "ids"),
    infer=lambda ins, a: [TensorType(ins[0].dtype, tuple(ins[1].shape) + (ins[0].shape[1],))])
def embedding(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Row lookup: weight[ids]."""
    return F.embedding(ids, weight)


def _linear_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    x, w = ins[0], ins[1]
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear: x {list(x.shape)} does not match weight {list(w.shape)} (want x[..., {w.shape[1]}])")
    return [TensorType(_promote(x.dtype, w.dtype), tuple(x.shape[:-1]) + (w.shape[0],))]


def _linear_flops(ins, outs, a, b: Mapping[str, int]) -> int:
    return 2 * outs[0].numel(b) * int(ins[1].shape[1])


@op("linear", kind="gemm", inputs=("x", "weight", "bias?"), infer=_linear_infer, flops=_linear_flops)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias); weight is [out_features, in_features] as in nn.Linear."""
    return F.linear(x, weight, bias)


def _matmul_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    x, y = ins[0], ins[1]
    if x.rank < 2 or y.rank < 2:
        raise ValueError(f"matmul needs rank >= 2 operands, got {x} and {y}")
    batch = broadcast_shapes(x.shape[:-2], y.shape[:-2])
    return [TensorType(_promote(x.dtype, y.dtype), tuple(batch) + (x.shape[-2], y.shape[-1]))]


def _matmul_flops(ins, outs, a, b) -> int:
    k = ins[0].shape[-1]
    from portlayer.flatten.ir import eval_dim

    return 2 * outs[0].numel(b) * eval_dim(k, b)


@op("matmul", kind="gemm", inputs=("x", "y"), infer=_matmul_infer, flops=_matmul_flops)
def matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Batched matrix product with broadcast batch dims (torch.matmul, rank >= 2)."""
    return torch.matmul(x, y)


def _norm_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    dts = [t.dtype for t in ins if t is not None]
    return [TensorType(_promote(*dts), ins[0].shape)]


@op("rms_norm", kind="reduction", inputs=("x", "weight?"), attrs={"eps": 1e-6, "weight_offset": 0.0},
    infer=_norm_infer, flops=out_numel_flops(4))
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
             weight_offset: float = 0.0) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) computed in float32, cast back to x's dtype, then
    times (weight + weight_offset): the Llama/Qwen order of operations."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = h.to(x.dtype)
    if weight is None:
        return y
    return (weight + weight_offset) * y if weight_offset else weight * y


@op("layer_norm", kind="reduction", inputs=("x", "weight?", "bias?"), attrs={"eps": 1e-5},
    infer=_norm_infer, flops=out_numel_flops(6))
def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last axis."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _softmax_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    return [ins[0].with_dtype(a["dtype"]) if a.get("dtype") else ins[0]]


@op("softmax", kind="reduction", inputs=("x",), attrs={"dim": -1, "dtype": None}, infer=_softmax_infer,
    flops=out_numel_flops(5))
def softmax(x: torch.Tensor, dim: int = -1, dtype: str | None = None) -> torch.Tensor:
    """Softmax along ``dim``; ``dtype`` converts the input first (torch's dtype= argument)."""
    return torch.softmax(x, dim, dtype=torch_dtype(dtype) if dtype else None)


def _reduce_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    s = list(ins[0].shape)
    dims = a["dims"] if a["dims"] else list(range(len(s)))
    dims = {norm_axis(d, len(s)) for d in dims}
    out = [1 if i in dims else d for i, d in enumerate(s)] if a["keepdim"] else [d for i, d in enumerate(s) if i not in dims]
    dtype = a.get("dtype") or ins[0].dtype
    return [TensorType(dtype, out)]


def _reduction(name: str, fn) -> None:
    def ref(x: torch.Tensor, dims: list[int] | None = None, keepdim: bool = False, dtype: str | None = None):
        if dtype:
            x = x.to(torch_dtype(dtype))
        d = list(dims) if dims else list(range(x.dim()))
        return fn(x, d, keepdim)

    ref.__doc__ = f"{name} over ``dims`` (all when empty); ``dtype`` converts the input first."
    op(name, kind="reduction", inputs=("x",), attrs={"dims": [], "keepdim": False, "dtype": None},
       infer=_reduce_infer, flops=lambda ins, outs, a, b: ins[0].numel(b))(ref)


_reduction("sum", lambda x, d, k: torch.sum(x, d, keepdim=k))
_reduction("mean", lambda x, d, k: torch.mean(x, d, keepdim=k))
_reduction("amax", lambda x, d, k: torch.amax(x, d, keepdim=k))
_reduction("amin", lambda x, d, k: torch.amin(x, d, keepdim=k))


@op("l2_normalize", kind="reduction", inputs=("x",), attrs={"dim": -1, "eps": 1e-12},
    infer=lambda ins, a: [ins[0]], flops=out_numel_flops(3))
def l2_normalize(x: torch.Tensor, dim: int = -1, eps: float = 1e-12) -> torch.Tensor:
    """x / max(||x||_2, eps) along ``dim`` (torch.nn.functional.normalize)."""
    return F.normalize(x, p=2.0, dim=dim, eps=eps)


def _pool_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    return [TensorType(ins[0].dtype, ("num_seqs", ins[0].shape[-1]))]


@op("pooling", kind="sequence", inputs=("x",), attrs={"mode": "mean"}, infer=_pool_infer,
    needs_context=True, flops=lambda ins, outs, a, b: ins[0].numel(b))
def pooling(x: torch.Tensor, mode: str = "mean", ctx: Any = None) -> torch.Tensor:
    """Per-sequence pooling of a [num_tokens, hidden] stream: 'mean', 'cls' (first token) or
    'last' (last token). Sequence boundaries come from the attention metadata
    (query_start_loc); without it the whole stream is one sequence."""
    meta = getattr(ctx, "attn_metadata", None)
    starts = [0, x.shape[0]] if meta is None else [int(v) for v in meta.query_start_loc.tolist()]
    rows = []
    for s, e in zip(starts[:-1], starts[1:]):
        seg = x[s:e]
        if mode == "mean":
            rows.append(seg.float().mean(0).to(x.dtype))
        elif mode == "cls":
            rows.append(seg[0])
        elif mode == "last":
            rows.append(seg[-1])
        else:
            raise ValueError(f"pooling mode {mode!r} is not one of mean, cls, last")
    return torch.stack(rows, 0)
