"""Columns of one [rows, 128] GEMM output into 3 dense buffers (64, 32, 32 columns)."""

import triton
import triton.language as tl
try:  # grid dependency control (Triton >= 3.4); without it no binary is compiled with PDL=True
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pointwise_split3_bf16_bce10d(
    c_ptr,
    out0_ptr,
    out1_ptr,
    out2_ptr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel's writes are visible after the wait
        gdc_wait()
        gdc_launch_dependents()
    # Program (t, j) copies columns [j * BLOCK, (j + 1) * BLOCK) of row t of the [rows, 128] input.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(c_ptr + t * 128 + cols, mask=cols < 128)
    # out0: columns [0, 64)
    tl.store(out0_ptr + t * 64 + (cols - 0), x, mask=(cols >= 0) & (cols < 64))
    # out1: columns [64, 96)
    tl.store(out1_ptr + t * 32 + (cols - 64), x, mask=(cols >= 64) & (cols < 96))
    # out2: columns [96, 128)
    tl.store(out2_ptr + t * 32 + (cols - 96), x, mask=(cols >= 96) & (cols < 128))
