"""Embedding lookup.

Row gather: out[t, :] = weight[ids[t], :], one program per token.
"""

import triton
import triton.language as tl
try:  # grid dependency control (Triton >= 3.4); without it no binary is compiled with PDL=True
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def embedding_bf16_1cf359(
    weight_ptr,
    ids_ptr,
    out_ptr,
    n_tokens,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel's writes are visible after the wait
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(ids_ptr + t).to(tl.int64)
    for start in tl.static_range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        tl.store(out_ptr + t * N + cols, tl.load(weight_ptr + row * N + cols, mask=mask), mask=mask)
