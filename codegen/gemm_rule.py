"""When the Triton GEMM runs instead of the vendor GEMM (cuBLAS / hipBLASLt via torch.mm).

The rule is a token-count threshold per device: at or below it the Triton GEMM (with its
fused epilogue) runs, above it the vendor GEMM. The threshold is descriptor data,
``tuning.triton_gemm_max_tokens``, with its measurement named in the descriptor's
``sources`` (benchmarks/bench_kernels.py, docs/gpu.md); a descriptor without it gets 0,
i.e. the vendor GEMM, which is the safe default for a device nobody measured.
"""

from __future__ import annotations

from typing import Any


def triton_gemm_max_tokens(descriptor: Any) -> int:
    """The descriptor's measured crossover ($.tuning.triton_gemm_max_tokens), else 0."""
    tuning = getattr(descriptor, "tuning", None) or {}
    return int(tuning.get("triton_gemm_max_tokens", 0))
