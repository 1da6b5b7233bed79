"""Rotary embedding (neox) of q and k after their per-head rms_norm, writing K and V into the paged cache.

Rotary embedding of q and k in one launch: one program per token rotates all HQ query
and HK key heads (constexprs). Style 'neox': feature i pairs with i + ROT/2 (rotate_half).
The cos/sin cache is [max_positions, ROT]: cos in the first half, sin in the second.
The kernel also writes the token's rotated K and its V into the paged KV cache through slot_mapping
(the attention kernels read them from there), in place of a separate reshape_and_cache launch.
"""

import triton
import triton.language as tl
try:  # grid dependency control (Triton >= 3.4); without it no binary is compiled with PDL=True
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def rope_kv_norm_neox_bf16_d76f07(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    q_w_ptr,
    k_w_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    q_out_ptr,
    k_out_ptr,
    n_tokens,
    q_eps,
    k_eps,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel's writes are visible after the wait
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_D)  # rotary pair index, i < ROT // 2
    imask = i < ROT // 2
    cos = tl.load(cache_ptr + pos * ROT + i, mask=imask, other=0.0)
    sin = tl.load(cache_ptr + pos * ROT + ROT // 2 + i, mask=imask, other=0.0)
    cos = cos.to(tl.bfloat16).to(tl.float32)  # the reference rotates in x's dtype
    sin = sin.to(tl.bfloat16).to(tl.float32)
    first = i
    second = i + ROT // 2
    h = tl.arange(0, BLOCK_H)
    # query heads
    base = t * HQ * D + h[:, None] * D
    m = (h[:, None] < HQ) & imask[None, :]
    x1 = tl.load(q_ptr + base + first[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(q_ptr + base + second[None, :], mask=m, other=0.0).to(tl.float32)
    # per-head rms_norm prologue over the D features of each head, rounded as the reference rounds
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    rstd = tl.rsqrt(ss / D + q_eps)[:, None]
    x1 = x1 * rstd
    x2 = x2 * rstd
    x1 = x1.to(tl.bfloat16).to(tl.float32)
    x2 = x2.to(tl.bfloat16).to(tl.float32)
    x1 = x1 * (tl.load(q_w_ptr + first, mask=imask, other=0.0).to(tl.float32))[None, :]
    x2 = x2 * (tl.load(q_w_ptr + second, mask=imask, other=0.0).to(tl.float32))[None, :]
    x1 = x1.to(tl.bfloat16).to(tl.float32)
    x2 = x2.to(tl.bfloat16).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(q_out_ptr + base + first[None, :], o1, mask=m)
    tl.store(q_out_ptr + base + second[None, :], o2, mask=m)
    # key heads
    base = t * HK * D + h[:, None] * D
    m = (h[:, None] < HK) & imask[None, :]
    x1 = tl.load(k_ptr + base + first[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(k_ptr + base + second[None, :], mask=m, other=0.0).to(tl.float32)
    # per-head rms_norm prologue over the D features of each head, rounded as the reference rounds
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    rstd = tl.rsqrt(ss / D + k_eps)[:, None]
    x1 = x1 * rstd
    x2 = x2 * rstd
    x1 = x1.to(tl.bfloat16).to(tl.float32)
    x2 = x2.to(tl.bfloat16).to(tl.float32)
    x1 = x1 * (tl.load(k_w_ptr + first, mask=imask, other=0.0).to(tl.float32))[None, :]
    x2 = x2 * (tl.load(k_w_ptr + second, mask=imask, other=0.0).to(tl.float32))[None, :]
    x1 = x1.to(tl.bfloat16).to(tl.float32)
    x2 = x2.to(tl.bfloat16).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(k_out_ptr + base + first[None, :], o1, mask=m)
    tl.store(k_out_ptr + base + second[None, :], o2, mask=m)
    # The rotated K heads (in k's dtype, as the cache copy of k would be) and V straight into the
    # paged cache at slot_mapping[t] (rows [HK, D] contiguous in a block); a negative slot writes nothing.
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    hk_lim = tl.where(slot >= 0, HK, 0)
    cbase = slot * HK * D + h[:, None] * D
    cm = (h[:, None] < hk_lim) & imask[None, :]
    kdt = k_out_ptr.dtype.element_ty
    tl.store(k_cache_ptr + cbase + first[None, :], o1.to(kdt), mask=cm)
    tl.store(k_cache_ptr + cbase + second[None, :], o2.to(kdt), mask=cm)
    dv = tl.arange(0, BLOCK_V)
    vm = (h[:, None] < hk_lim) & (dv[None, :] < D)
    vrow = tl.load(v_ptr + t * HK * D + h[:, None] * D + dv[None, :], mask=vm)
    tl.store(v_cache_ptr + cbase + dv[None, :], vrow, mask=vm)
