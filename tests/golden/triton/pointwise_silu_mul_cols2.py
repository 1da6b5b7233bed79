"""Fused pointwise: silu -> mul, over the columns of one [rows, 256] GEMM output."""

import triton
import triton.language as tl
try:  # grid dependency control (Triton >= 3.4); without it no binary is compiled with PDL=True
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pointwise_silu_mul_cols2_deab1c(
    c_ptr,
    out0_ptr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel's writes are visible after the wait
        gdc_wait()
        gdc_launch_dependents()
    # Program (row, j) writes columns [j * BLOCK, (j + 1) * BLOCK) of one row of the [rows, 128] output:
    # its loads and stores are contiguous runs (a flat index split by // and % 128 would not vectorize).
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < 128
    offs = row * 128 + col
    x0 = tl.load(c_ptr + row * 256 + 0 + col, mask=mask, other=0).to(tl.float32)
    x1 = tl.load(c_ptr + row * 256 + 128 + col, mask=mask, other=0).to(tl.float32)
    t0 = x0 * tl.sigmoid(x0)  # silu
    t1 = t0 * x1  # mul
    tl.store(out0_ptr + offs, t1, mask=mask)
