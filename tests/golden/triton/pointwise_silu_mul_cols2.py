"""Fused pointwise: silu -> mul, over the columns of one [rows, 256] GEMM output."""

import triton
import triton.language as tl
try:  # grid dependency control (Triton >= 3.4); without it no binary is compiled with PDL=True
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pointwise_silu_mul_cols2_e10d1e(
    c_ptr,
    out0_ptr,
    n_elements,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel's writes are visible after the wait
        gdc_wait()
        gdc_launch_dependents()
    # One program writes BLOCK consecutive elements of the output(s).
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    row = offs // 128
    col = offs % 128
    x0 = tl.load(c_ptr + row * 256 + 0 + col, mask=mask, other=0).to(tl.float32)
    x1 = tl.load(c_ptr + row * 256 + 128 + col, mask=mask, other=0).to(tl.float32)
    t0 = x0 * tl.sigmoid(x0)  # silu
    t1 = t0 * x1  # mul
    tl.store(out0_ptr + offs, t1, mask=mask)
