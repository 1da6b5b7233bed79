"""Varlen flash attention (prefill).

Variable-length causal flash attention over the packed token stream.
Grid (num_tokens // BLOCK_M + num_seqs, 1, HQ): one program owns BLOCK_M query rows of one
sequence of more than one new token and one head; it finds its sequence from query_start_loc on the device
(sequence i owns programs qsl[i] // BLOCK_M + i onwards), so the grid depends on the step's sizes alone
and a CUDA graph of a step replays for any split of its tokens into sequences. Sequences of one new
token are the decode kernel's. Keys and values come from the paged cache through the block
table, so a sequence whose first tokens are already cached (prefix caching, or an earlier
chunk of a chunked prefill) attends to them: its new tokens sit at positions
seq_len - query_len .. seq_len - 1.
"""

import triton
import triton.language as tl
try:  # grid dependency control (Triton >= 3.4); without it no binary is compiled with PDL=True
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def attn_prefill_paged_bf16_4b53b6(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    bt_stride,
    num_seqs,
    scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel's writes are visible after the wait
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    # This program's sequence: the last i with qsl[i] // BLOCK_M + i <= pid (strictly increasing in i; sequence i
    # owns qsl[i + 1] // BLOCK_M - qsl[i] // BLOCK_M + 1 >= cdiv(q_len, BLOCK_M) programs), by bisection.
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_M + mid <= pid:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    mblock = pid - (q_start // BLOCK_M + seq)
    head = tl.program_id(2)
    kvh = head // GROUP
    if (q_len > 1) & (mblock * BLOCK_M < q_len):
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len  # tokens cached before this step
        m = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        qmask = m < q_len
        dmask = d < D
        q_pos = context + m
        q_rows = (q_start + m).to(tl.int64) * HQ * D + head * D
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=qmask[:, None] & dmask[None, :], other=0.0)
        hi = tl.minimum(seq_len, context + (mblock + 1) * BLOCK_M)
        lo = 0
        # Scores in log2 units (exp2 is one instruction; exp is exp2 plus a multiply).
        qk_scale = scale * 1.4426950408889634
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        # Key blocks wholly at or before this block's first query position need no mask at all: they
        # are loaded unmasked and scored without the causal test; only the blocks on the diagonal are.
        full = lo + tl.maximum(0, tl.minimum(hi, context + mblock * BLOCK_M + 1) - lo) // BLOCK_N * BLOCK_N
        for start in range(lo, full, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            block = tl.load(block_tables_ptr + seq.to(tl.int64) * bt_stride + n // BLOCK_SIZE)
            kv_rows = (block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE) * HKV * D + kvh * D
            k = tl.load(k_ptr + kv_rows[:, None] + d[None, :])
            v = tl.load(v_ptr + kv_rows[:, None] + d[None, :])
            s = tl.dot(q, tl.trans(k)) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = m_new  # every row has a visible key in an unmasked block
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        for start in range(full, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nmask = n < hi
            block = tl.load(block_tables_ptr + seq.to(tl.int64) * bt_stride + n // BLOCK_SIZE, mask=nmask, other=0)
            kv_rows = (block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE) * HKV * D + kvh * D
            kvmask = nmask[:, None]
            k = tl.load(k_ptr + kv_rows[:, None] + d[None, :], mask=kvmask, other=0.0)
            v = tl.load(v_ptr + kv_rows[:, None] + d[None, :], mask=kvmask, other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            keep = nmask[None, :]
            keep = keep & (n[None, :] <= q_pos[:, None])
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        tl.store(out_ptr + q_rows[:, None] + d[None, :], out, mask=qmask[:, None] & dmask[None, :])
