"""3 matrix multiplies of one activation for few rows, in one launch.

C_i[M, N_i] = A[M, K] @ W_i[N_i, K]^T for 3 linears that read the same activation (Q, K and V
projections, say), in one launch, for a few rows (decode), accumulated in float32.
The programs are split among the weights: the first cdiv(N_0, BLOCK_N) take W_0's columns, the next
W_1's, and so on; each streams its [BLOCK_N, K] slice of W once, as in the single-weight kernel. One
launch instead of 3: at decode each of these GEMMs is a few microseconds of reading, so the
launch and the ramp-up of every kernel are a large part of its time.
A is the residual add + RMSNorm of the kernel's input, computed in every program's prologue (one more launch saved).
"""

import triton
import triton.language as tl
try:  # grid dependency control (Triton >= 3.4); without it no binary is compiled with PDL=True
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def gemv_x3_add_rms_bf16_8c36dd(
    a_ptr,
    res_ptr,
    sum_ptr,
    nw_ptr,
    w0_ptr,
    w1_ptr,
    w2_ptr,
    c0_ptr,
    c1_ptr,
    c2_ptr,
    N0,
    N1,
    N2,
    M,
    eps,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    if pid < tl.cdiv(N0, BLOCK_N):
        w_ptr = w0_ptr
        c_ptr = c0_ptr
        N = N0
        pid_n = pid
    elif pid < tl.cdiv(N0, BLOCK_N) + tl.cdiv(N1, BLOCK_N):
        w_ptr = w1_ptr
        c_ptr = c1_ptr
        N = N1
        pid_n = pid - (tl.cdiv(N0, BLOCK_N))
    else:
        w_ptr = w2_ptr
        c_ptr = c2_ptr
        N = N2
        pid_n = pid - (tl.cdiv(N0, BLOCK_N) + tl.cdiv(N1, BLOCK_N))
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(a[:, None, :] * w[None, :, :], axis=2)
    cmask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=cmask)
