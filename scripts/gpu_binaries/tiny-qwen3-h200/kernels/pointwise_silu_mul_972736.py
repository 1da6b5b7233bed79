"""Fused pointwise: silu -> mul."""

import triton
import triton.language as tl


@triton.jit
def pointwise_silu_mul_972736(
    x0_ptr,
    x1_ptr,
    out0_ptr,
    n_elements,
    BLOCK: tl.constexpr,
):
    # One program writes BLOCK consecutive elements of the output(s).
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    x0 = tl.load(x0_ptr + offs, mask=mask, other=0).to(tl.float32)
    x1 = tl.load(x1_ptr + offs, mask=mask, other=0).to(tl.float32)
    t0 = x0 * tl.sigmoid(x0)  # silu
    t1 = t0 * x1  # mul
    tl.store(out0_ptr + offs, t1, mask=mask)
