"""When the Triton GEMM runs instead of the vendor GEMM (cuBLAS / hipBLASLt via torch.mm).

The rule is a token-count threshold per device: at or below it the Triton GEMM (with its
fused epilogue) runs, above it the vendor GEMM. Thresholds come from measurement
(benchmarks/bench_kernels.py, docs/gpu.md); a device nobody measured gets 0, i.e. the
vendor GEMM, which is the safe default.
"""

from __future__ import annotations

from typing import Any

#: arch -> largest token count at which the Triton GEMM beat torch.mm (measured; see docs/gpu.md).
#: sm_90 (H200, bf16, Qwen3-0.6B shapes, T in 1..2048): torch.mm won or tied everywhere
#: (Triton/mm time 1.2-2.1x for q/gate/down at every T; lm_head tied at T <= 64, lost above),
#: so the rule is 0: always the vendor GEMM. Re-measure when the GEMM template changes.
MEASURED_MAX_TOKENS: dict[str, int] = {"sm_90": 0}


def triton_gemm_max_tokens(descriptor: Any) -> int:
    return MEASURED_MAX_TOKENS.get(getattr(descriptor, "arch", ""), 0)
