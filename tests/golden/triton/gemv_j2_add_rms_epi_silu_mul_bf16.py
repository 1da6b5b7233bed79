"""2 matrix multiplies of one activation and their fused epilogue for few rows, in one launch.

Y_i = A[M, K] @ W_i[N, K]^T for 2 linears of one activation and equal N (gate and up, say),
then the fused epilogue over them (silu(gate) * up), for a few rows (decode), accumulated in float32.
Every program owns the same BLOCK_N columns of each W_i and streams those slices once along K,
so the products meet in registers: one launch, and no Y_i ever goes to memory.
A is the residual add + RMSNorm of the kernel's input, computed in every program's prologue (one more launch saved).
"""

import triton
import triton.language as tl
try:  # grid dependency control (Triton >= 3.4); without it no binary is compiled with PDL=True
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def gemv_j2_add_rms_epi_silu_mul_bf16_bb2fab(
    a_ptr,
    res_ptr,
    sum_ptr,
    nw_ptr,
    w0_ptr,
    w1_ptr,
    c_ptr,
    M,
    eps,
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
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [w0_ptr + pf_rows + pf_cols],
                                      dtype=tl.int32, is_pure=False, pack=1)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [w1_ptr + pf_rows + pf_cols],
                                      dtype=tl.int32, is_pure=False, pack=1)
        gdc_wait()
        gdc_launch_dependents()
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Prologue: residual add + RMSNorm of the M rows, per program (K is the whole row).
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        xmask = (rm[:, None] < M) & (rk < K)[None, :]
        xoffs = rm[:, None].to(tl.int64) * K + rk[None, :]
        x = tl.load(a_ptr + xoffs, mask=xmask, other=0.0).to(tl.float32)
        x = x + tl.load(res_ptr + xoffs, mask=xmask, other=0.0).to(tl.float32)
        x = x.to(tl.bfloat16).to(tl.float32)
        if pid == 0:  # the residual sum, written once
            tl.store(sum_ptr + xoffs, x, mask=xmask)
        sq += tl.sum(x * x, axis=1)
    rstd = tl.rsqrt(sq / K + eps)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        xoffs = rm[:, None].to(tl.int64) * K + rk[None, :]
        a = tl.load(a_ptr + xoffs, mask=(rm[:, None] < M) & kmask[None, :], other=0.0).to(tl.float32)
        a = a + tl.load(res_ptr + xoffs, mask=(rm[:, None] < M) & kmask[None, :], other=0.0).to(tl.float32)
        a = a.to(tl.bfloat16).to(tl.float32)
        a = a * rstd[:, None]
        a = a.to(tl.bfloat16).to(tl.float32)  # HF casts back to the input dtype before the weight
        nw = tl.load(nw_ptr + rk, mask=kmask, other=0.0).to(tl.float32)
        a = a * nw[None, :]
        a = a.to(tl.bfloat16).to(tl.float32)  # the norm's output dtype, as the GEMM would read it
        woffs = rn[:, None].to(tl.int64) * K + rk[None, :]
        wmask = nmask[:, None] & kmask[None, :]
        w0 = tl.load(w0_ptr + woffs, mask=wmask, other=0.0).to(tl.float32)
        acc0 += tl.sum(a[:, None, :] * w0[None, :, :], axis=2)
        w1 = tl.load(w1_ptr + woffs, mask=wmask, other=0.0).to(tl.float32)
        acc1 += tl.sum(a[:, None, :] * w1[None, :, :], axis=2)
    cmask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    y0 = acc0
    y0 = y0.to(tl.bfloat16).to(tl.float32)  # each linear's output is rounded before the epilogue
    y1 = acc1
    y1 = y1.to(tl.bfloat16).to(tl.float32)  # each linear's output is rounded before the epilogue
    t0 = y0 * tl.sigmoid(y0)  # silu
    t1 = t0 * y1  # mul
    y = t1
    tl.store(c_ptr + offs, y, mask=cmask)
