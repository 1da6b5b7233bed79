"""When the Triton GEMM runs instead of the vendor GEMM (cuBLAS / hipBLASLt via torch.mm).

The rule is a token-count threshold per device: at or below it the Triton GEMM (with its
fused epilogue) runs, above it the vendor GEMM. Thresholds come from measurement
(benchmarks/bench_kernels.py, docs/gpu.md); a device nobody measured gets 0, i.e. the
vendor GEMM, which is the safe default.
"""

from __future__ import annotations

from typing import Any

#: arch -> largest token count at which the Triton GEMM beat torch.mm (measured; see docs/gpu.md).
MEASURED_MAX_TOKENS: dict[str, int] = {}


def triton_gemm_max_tokens(descriptor: Any) -> int:
    return MEASURED_MAX_TOKENS.get(getattr(descriptor, "arch", ""), 0)
