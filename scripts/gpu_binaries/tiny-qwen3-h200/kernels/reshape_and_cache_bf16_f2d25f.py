"""Write new K/V into the paged cache.

Write each token's new K and V ([HKV, D] each) into the paged caches
[num_blocks, block_size, HKV, D] at slot_mapping[t] = block * block_size + offset.
Because a block's rows are contiguous, slot * HKV * D is the row's offset. Negative
slots (padding, tokens whose KV is already cached) are skipped.
"""

import triton
import triton.language as tl


@triton.jit
def reshape_and_cache_bf16_f2d25f(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    n_tokens,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    limit = tl.where(slot >= 0, ROW, 0)  # a negative slot writes nothing
    mask = cols < limit
    tl.store(k_cache_ptr + slot * ROW + cols, tl.load(k_ptr + t * ROW + cols, mask=mask), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, tl.load(v_ptr + t * ROW + cols, mask=mask), mask=mask)
