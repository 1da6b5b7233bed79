"""matrix multiply for few rows.

C[M, N] = A[M, K] @ W[N, K]^T for a few rows (decode), accumulated in float32.
At a handful of rows a matrix multiply is a read of W: each program owns BLOCK_N output columns for
all M rows, streams its [BLOCK_N, K] slice of W once in [BLOCK_N, BLOCK_K] tiles along K (contiguous,
16-byte loads), and multiplies on the CUDA cores; no tensor-core tile pads the rows to 16.
"""

import triton
import triton.language as tl
try:  # grid dependency control (Triton >= 3.4); without it no binary is compiled with PDL=True
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def gemv_bf16_fa8977(
    a_ptr,
    w_ptr,
    c_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    if PDL:  # programmatic dependent launch: prefetch the weights (no kernel writes them), then wait
        pf_rows = tl.minimum(rn, N - 1).to(tl.int64)[:, None] * K
        for pf_k in range(0, K, BLOCK_K):
            pf_cols = tl.minimum(pf_k + tl.arange(0, BLOCK_K // 32) * 32, K - 1)[None, :]
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [w_ptr + pf_rows + pf_cols],
                                      dtype=tl.int32, is_pure=False, pack=1)
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=(rm[:, None] < M) & kmask[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(a[:, None, :] * w[None, :, :], axis=2)

    y = acc
    cmask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(c_ptr + offs, y, mask=cmask)
