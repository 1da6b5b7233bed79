"""Attention for torch-codegen programs (the CPU): every sequence of a step in one batched
``scaled_dot_product_attention`` call instead of one einsum/softmax pair per sequence.

The reference (flatten/op_defs/attention.py) stays the semantics and the oracle; this is the
same computation for a whole step: new K/V written to the paged cache, each sequence's context
gathered (from the cache, or its own new tokens without one), padded to the step's longest query
and context, and masked by key validity, causality and the sliding window (two-sided without
causality), in float32 like the reference. Padded query rows are dropped on the way out.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.utils.rnn import pad_sequence

from portlayer.flatten.op_defs.attention import read_kv_cache, visible_keys, write_kv_cache


def attention_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, st: Any, *, layer: int,
                      scale: float | None, causal: bool, sliding_window: int | None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] of one step -> [T, Hq, Dv] (q's dtype)."""
    meta, caches = st.meta, st.kv_caches
    if caches is not None and meta.slot_mapping is not None:
        k_cache, v_cache = caches[layer]
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    starts = meta.query_start_loc.tolist()
    spans = [(s, e) for s, e in zip(starts[:-1], starts[1:])]
    lq = [e - s for s, e in spans]
    paged = caches is not None and meta.block_tables is not None
    if paged:
        k_cache, v_cache = caches[layer]
        lens = meta.seq_lens.tolist()
        ctx = [read_kv_cache(k_cache, v_cache, meta.block_tables[b], lens[b]) for b in range(len(spans))]
    else:
        lens = lq
        ctx = [(k[s:e], v[s:e]) for s, e in spans]
    qp = pad_sequence([q[s:e] for s, e in spans], batch_first=True).float().transpose(1, 2)  # [B, Hq, Lq, D]
    kp = pad_sequence([c[0] for c in ctx], batch_first=True).float().transpose(1, 2)  # [B, Hkv, S, D]
    vp = pad_sequence([c[1] for c in ctx], batch_first=True).float().transpose(1, 2)
    dev = q.device
    lens_t = torch.tensor(lens, device=dev)
    qpos = (lens_t - torch.tensor(lq, device=dev))[:, None] + torch.arange(qp.shape[2], device=dev)[None, :]
    kpos = torch.arange(kp.shape[2], device=dev)[None, None, :]
    mask = (kpos < lens_t[:, None, None]) & visible_keys(qpos[:, :, None], kpos, causal, sliding_window)  # [B, Lq, S]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=qp.shape[1] != kp.shape[1])  # [B, Hq, Lq, Dv]
    out = out.transpose(1, 2)
    return torch.cat([out[b, :n] for b, n in enumerate(lq)]).to(q.dtype)
