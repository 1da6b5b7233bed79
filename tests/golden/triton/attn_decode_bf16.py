"""Split-K paged decode attention.

Paged attention for decode sequences (one new token each), flash-decoding style.
Grid (num_decode_seqs, HKV, num_splits), from sequence seq_offset on (a CUDA graph of a step with prefill tokens
launches one program per sequence slot from 0: those of other sequences return at once); each program takes the GQA group of GROUP
query heads that share one KV head (padded to BLOCK_H rows so tl.dot can be used) and one
slice of the sequence's keys, BLOCK_N tokens a step, each token's cache row found through
the block table (so a step spans pages of any BLOCK_SIZE). num_splits is chosen per step by
the host (codegen/host_support.decode_splits: enough programs for the device, at most
NUM_SPLITS): with one split a program normalises and writes its output; with more, partial
results (unnormalised output, running max, running sum) go to scratch and attn_decode_bf16_dcb7e0_reduce
merges them. Cache layout: [num_blocks, BLOCK_SIZE, HKV, D].
"""

import triton
import triton.language as tl
try:  # grid dependency control (Triton >= 3.4); without it no binary is compiled with PDL=True
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def attn_decode_bf16_dcb7e0(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    seq_offset,
    bt_stride,
    num_splits,
    scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel's writes are visible after the wait
        gdc_wait()
        gdc_launch_dependents()
    i = tl.program_id(0)  # decode sequence, counted from the first decode
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = i + seq_offset
    seq_len = tl.load(seq_lens_ptr + seq)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < GROUP
    dmask = d < D
    heads = kvh * GROUP + h
    part = (i * HQ + heads).to(tl.int64) * NUM_SPLITS + split  # the scratch layout is NUM_SPLITS wide
    tok = tl.load(query_start_ptr + seq).to(tl.int64)
    if tl.load(query_start_ptr + seq + 1) - tok != 1:  # not a decode: a prefill's (the prefill kernel's) or no row
        return
    out_rows = out_ptr + tok * HQ * D + heads[:, None] * D + d[None, :]

    n_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    lo = 0
    per_split = (n_tiles - lo + num_splits - 1) // num_splits
    first = lo + split * per_split
    last = tl.minimum(first + per_split, n_tiles)
    if first >= last:  # an empty (padding) sequence, or a split a short sequence leaves empty
        if num_splits == 1:
            tl.store(out_rows, tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32),
                     mask=hmask[:, None] & dmask[None, :])
        else:  # contributes nothing to the merge
            tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32),
                     mask=hmask[:, None])
            tl.store(part_max_ptr + part, tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32), mask=hmask)
            tl.store(part_sum_ptr + part, tl.zeros((BLOCK_H,), dtype=tl.float32), mask=hmask)
        return
    q = tl.load(q_ptr + tok * HQ * D + heads[:, None] * D + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    offs = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for j in range(first, last):
        kpos = j * BLOCK_N + offs
        kmask = kpos < seq_len
        page = tl.load(table + kpos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
        rows = (page * BLOCK_SIZE + kpos % BLOCK_SIZE)[:, None] * (HKV * D) + kvh * D + d[None, :]
        k = tl.load(k_cache_ptr + rows, mask=kmask[:, None] & dmask[None, :], other=0.0)
        v = tl.load(v_cache_ptr + rows, mask=kmask[:, None] & dmask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked step adds nothing
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if num_splits == 1:  # the whole sequence was this program's: normalise and write the output
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_rows, o, mask=hmask[:, None] & dmask[None, :])
    else:
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=hmask[:, None])
        tl.store(part_max_ptr + part, m_i, mask=hmask)
        tl.store(part_sum_ptr + part, l_i, mask=hmask)


@triton.jit
def attn_decode_bf16_dcb7e0_reduce(
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_start_ptr,
    out_ptr,
    seq_offset,
    num_splits,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel's writes are visible after the wait
        gdc_wait()
        gdc_launch_dependents()
    i = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(query_start_ptr + i + seq_offset).to(tl.int64)
    if tl.load(query_start_ptr + i + seq_offset + 1) - tok != 1:  # not a decode sequence (see the kernel above)
        return
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    part = (i * HQ + head).to(tl.int64) * NUM_SPLITS + sp
    used = sp < num_splits  # the step ran num_splits of the NUM_SPLITS slots
    m = tl.load(part_max_ptr + part, mask=used, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=used, other=0.0)
    acc = tl.load(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], mask=used[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp(m - m_all)  # splits that saw no keys have m = -inf and weigh 0
    total = tl.sum(l * w, axis=0)
    total = tl.where(total == 0.0, 1.0, total)  # an empty (padding) sequence writes zeros
    o = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(out_ptr + tok * HQ * D + head * D + d, o, mask=d < D)
