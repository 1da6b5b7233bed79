"""Row residual add + rms_norm.

One program normalises one row of N elements held in registers (BLOCK_N >= N, both constexpr).
"""

import triton
import triton.language as tl
try:  # grid dependency control (Triton >= 3.4); without it no binary is compiled with PDL=True
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def reduction_add_rms_norm_bf16_e08443(
    x_ptr,
    res_ptr,
    sum_ptr,
    w_ptr,
    out_ptr,
    n_rows,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel's writes are visible after the wait
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    # Prologue: the residual add, rounded to the activation dtype as the reference does.
    x = x + tl.load(res_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    x = x.to(tl.bfloat16).to(tl.float32)
    tl.store(sum_ptr + row * N + cols, x, mask=mask)
    mean_sq = tl.sum(x * x, axis=0) / N
    y = x * tl.rsqrt(mean_sq + eps)
    y = y.to(tl.bfloat16).to(tl.float32)  # HF casts back to the input dtype before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = y * w
    tl.store(out_ptr + row * N + cols, y, mask=mask)
