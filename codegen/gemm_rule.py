"""When the Triton GEMM runs instead of the vendor GEMM (cuBLAS / hipBLASLt via torch.mm).

The rule is a token-count threshold per device: at or below it the Triton GEMM (with its
fused epilogue) runs, above it the vendor GEMM. The threshold is descriptor data,
``tuning.triton_gemm_max_tokens``, with its measurement named in the descriptor's
``sources`` (benchmarks/bench_kernels.py, docs/gpu.md); a descriptor without it gets 0,
i.e. the vendor GEMM, which is the safe default for a device nobody measured.

Below both, ``tuning.gemv_max_tokens``: at or below it (decode) the few-rows kernel
(templates/triton/gemv.py.j2) runs, which reads the weight once on the CUDA cores instead of
padding the rows to a tensor-core tile; weight-only quantized linears use it too.
"""

from __future__ import annotations

from typing import Any


def gemv_max_tokens(descriptor: Any) -> int:
    """The descriptor's measured few-rows crossover ($.tuning.gemv_max_tokens), else 0 (never)."""
    tuning = getattr(descriptor, "tuning", None) or {}
    return int(tuning.get("gemv_max_tokens", 0))


def triton_gemm_max_tokens(descriptor: Any) -> int:
    """The descriptor's measured crossover ($.tuning.triton_gemm_max_tokens), else 0."""
    tuning = getattr(descriptor, "tuning", None) or {}
    return int(tuning.get("triton_gemm_max_tokens", 0))
