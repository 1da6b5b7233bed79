"""Split-K paged decode attention.

Paged attention for decode sequences (one new token each), flash-decoding style.
Grid (num_decode_seqs, HKV, num_splits): each program takes the GQA group of GROUP query heads
that share one KV head (padded to BLOCK_H rows so tl.dot can be used) and one slice of the
sequence's tokens, BLOCK_N at a time, each token's cache row found through the block table
(page = bt[pos // BLOCK_SIZE], row = pos % BLOCK_SIZE), so a tile spans several pages (or part
of one). num_splits is a runtime value (the host picks it per batch size, at most MAX_SPLITS,
which sizes the scratch). With several splits, partial results (unnormalised output, running
max, running sum) go to scratch and attn_decode_bf16_f524eb_reduce merges the live splits; with one split the
program normalises and writes the output itself and no reduce runs.
Cache layout: [num_blocks, BLOCK_SIZE, HKV, D].
"""

import triton
import triton.language as tl


@triton.jit
def attn_decode_bf16_f524eb(
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
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
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
    part = (i * HQ + heads).to(tl.int64) * MAX_SPLITS + split

    n_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    lo_tile = 0
    n_live = n_tiles - lo_tile  # split evenly: every split gets floor or ceil of n_live / num_splits tiles
    first = lo_tile + (split * n_live) // num_splits
    last = lo_tile + ((split + 1) * n_live) // num_splits
    tok = tl.load(query_start_ptr + seq).to(tl.int64)
    q = tl.load(q_ptr + tok * HQ * D + heads[:, None] * D + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    offs = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * bt_stride
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for j in range(first, last):  # an empty slice (a short or padding sequence) runs no iteration
        kpos = j * BLOCK_N + offs
        kmask = kpos < seq_len
        page = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
        rows = (page * BLOCK_SIZE + kpos % BLOCK_SIZE) * (HKV * D) + kvh * D
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kmask[:, None] & dmask[None, :], other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kmask[:, None] & dmask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked tile adds nothing
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if num_splits == 1:  # the whole sequence was this program's: normalise and write the output (no reduce)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # an empty (padding) sequence writes zeros
        tl.store(out_ptr + tok * HQ * D + heads[:, None] * D + d[None, :], o, mask=hmask[:, None] & dmask[None, :])
    else:  # an empty slice stores m = -inf, l = 0 and weighs nothing in the merge
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=hmask[:, None])
        tl.store(part_max_ptr + part, m_i, mask=hmask)
        tl.store(part_sum_ptr + part, l_i, mask=hmask)


@triton.jit
def attn_decode_bf16_f524eb_reduce(
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
    MAX_SPLITS: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(query_start_ptr + i + seq_offset).to(tl.int64)
    sp = tl.arange(0, MAX_SPLITS)
    live = sp < num_splits  # slots past this launch's split count hold stale data: never read
    d = tl.arange(0, BLOCK_D)
    part = (i * HQ + head).to(tl.int64) * MAX_SPLITS + sp
    m = tl.load(part_max_ptr + part, mask=live, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=live, other=0.0)
    acc = tl.load(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], mask=live[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp(m - m_all)  # splits that saw no keys have m = -inf and weigh 0
    total = tl.sum(l * w, axis=0)
    total = tl.where(total == 0.0, 1.0, total)  # an empty (padding) sequence writes zeros
    o = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(out_ptr + tok * HQ * D + head * D + d, o, mask=d < D)
