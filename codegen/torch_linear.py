"""The CPU program's linear through MKL's packed sgemm: the weight is packed once (on its first
step) instead of on every call, which is a visible share of the GEMM at the embedding models'
small K and N (MiniLM: ~8% of each GEMM at 504 rows, same results to the bit in our checks).

The packed copy doubles that weight's memory, so the lowering (backends/impls_torch.py) takes
only small weights. A torch build without MKL keeps ``torch.addmm``.
"""

from __future__ import annotations

import torch

HAVE_MKL = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ w[N, K].T + b, the weight packed for MKL on first use (kept on the tensor)."""
    if not HAVE_MKL or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        return torch.addmm(b, x, w.t()) if b is not None else torch.mm(x, w.t())
    packed = getattr(w, "_portlayer_mkl_packed", None)
    if packed is None:  # two workers racing here pack twice; either result is the same
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, max(1, x.shape[0]))
        w._portlayer_mkl_packed = packed
    return torch.ops.mkl._mkl_linear(x, packed, w, b, max(1, x.shape[0]))
