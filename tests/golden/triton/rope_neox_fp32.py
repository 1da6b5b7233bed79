"""Rotary embedding (neox) of q and k.

Rotary embedding of q and k in one launch: one program per token rotates all 4 query
and 2 key heads. Style 'neox': feature i pairs with i + ROT/2 (rotate_half).
The cos/sin cache is [max_positions, ROT]: cos in the first half, sin in the second.
"""

import triton
import triton.language as tl


@triton.jit
def rope_neox_fp32_557a5f(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    q_out_ptr,
    k_out_ptr,
    n_tokens,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_D)  # rotary pair index, i < ROT // 2
    imask = i < ROT // 2
    cos = tl.load(cache_ptr + pos * ROT + i, mask=imask, other=0.0)
    sin = tl.load(cache_ptr + pos * ROT + ROT // 2 + i, mask=imask, other=0.0)
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    first = i
    second = i + ROT // 2
    h = tl.arange(0, BLOCK_H)
    # query heads
    base = t * HQ * D + h[:, None] * D
    m = (h[:, None] < HQ) & imask[None, :]
    x1 = tl.load(q_ptr + base + first[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(q_ptr + base + second[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(q_out_ptr + base + first[None, :], x1 * cos[None, :] - x2 * sin[None, :], mask=m)
    tl.store(q_out_ptr + base + second[None, :], x2 * cos[None, :] + x1 * sin[None, :], mask=m)
    # key heads
    base = t * HK * D + h[:, None] * D
    m = (h[:, None] < HK) & imask[None, :]
    x1 = tl.load(k_ptr + base + first[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(k_ptr + base + second[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(k_out_ptr + base + first[None, :], x1 * cos[None, :] - x2 * sin[None, :], mask=m)
    tl.store(k_out_ptr + base + second[None, :], x2 * cos[None, :] + x1 * sin[None, :], mask=m)
