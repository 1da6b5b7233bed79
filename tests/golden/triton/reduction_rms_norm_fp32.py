"""Row rms_norm.

One program normalises one row of N = 16 elements held in registers (BLOCK_N >= N).
"""

import triton
import triton.language as tl


@triton.jit
def reduction_rms_norm_fp32_8c1f7c(
    x_ptr,
    w_ptr,
    out_ptr,
    n_rows,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / N
    y = x * tl.rsqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = y * w
    tl.store(out_ptr + row * N + cols, y, mask=mask)
