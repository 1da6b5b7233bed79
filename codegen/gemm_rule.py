"""When the Triton GEMM runs instead of the vendor GEMM (cuBLAS / hipBLASLt via torch.mm).

The rule is a token-count threshold per device: at or below it the Triton GEMM (with its
fused epilogue) runs, above it the vendor GEMM. The threshold is descriptor data,
``tuning.triton_gemm_max_tokens``, with its measurement named in the descriptor's
``sources`` (benchmarks/bench_kernels.py, docs/gpu.md); a descriptor without it gets 0,
i.e. the vendor GEMM, which is the safe default for a device nobody measured.

Below both, ``tuning.gemv_max_tokens``: at or below it (decode) the few-rows kernel
(templates/triton/gemv.py.j2) runs, which reads the weight once on the CUDA cores instead of
padding the rows to a tensor-core tile; weight-only quantized linears use it too. Weights above
``tuning.gemv_max_weight_mib`` (a vocabulary projection, say) keep the vendor GEMM at every row
count: where one launch streams hundreds of megabytes, cuBLAS's GEMV reads faster.

Weight-only quantized linears (``linear_wq``) above the few-rows rule: from
``tuning.wq_vendor_min_tokens`` rows the weight is dequantized into a temporary (one launch) and the
vendor GEMM runs on it; below it (or without the field) the Triton weight-only GEMM.
"""

from __future__ import annotations

from typing import Any


def _tuning(descriptor: Any, key: str) -> float:
    return float((getattr(descriptor, "tuning", None) or {}).get(key, 0))


def gemv_max_tokens(descriptor: Any) -> int:
    """The descriptor's measured few-rows crossover ($.tuning.gemv_max_tokens), else 0 (never)."""
    return int(_tuning(descriptor, "gemv_max_tokens"))


def gemv_dot_max_tokens(descriptor: Any) -> int:
    """Rows up to which the tensor-core tier of the few-rows kernels runs, above gemv_max_tokens
    ($.tuning.gemv_dot_max_tokens), else 0 (no tier). A value at or below gemv_max_tokens adds nothing."""
    return int(_tuning(descriptor, "gemv_dot_max_tokens"))


def few_rows_limit(descriptor: Any) -> int:
    """The most rows any few-rows kernel (CUDA-core or tensor-core tier) takes: where fusing a norm
    prologue or a joint epilogue into one launch pays off (passes/fuse.py, the cost model)."""
    return max(gemv_max_tokens(descriptor), gemv_dot_max_tokens(descriptor))


def gemv_max_weight_bytes(descriptor: Any) -> int:
    """The largest weight the few-rows kernel takes ($.tuning.gemv_max_weight_mib), else 0 (any)."""
    return int(_tuning(descriptor, "gemv_max_weight_mib") * 2**20)


def triton_gemm_max_tokens(descriptor: Any) -> int:
    """The descriptor's measured crossover ($.tuning.triton_gemm_max_tokens), else 0."""
    return int(_tuning(descriptor, "triton_gemm_max_tokens"))


def wq_vendor_min_tokens(descriptor: Any) -> int:
    """Rows from which a weight-only quantized linear dequantizes its weight into a temporary and runs the
    vendor GEMM ($.tuning.wq_vendor_min_tokens), else 0: never (the Triton weight-only GEMM at every row count)."""
    return int(_tuning(descriptor, "wq_vendor_min_tokens"))
