"""Attention for torch-codegen programs (the CPU): every sequence of a step in one batched
``scaled_dot_product_attention`` call instead of one einsum/softmax pair per sequence.

The reference (flatten/op_defs/attention.py) stays the semantics and the oracle; this is the
same computation for a whole step: new K/V written to the paged cache, each sequence's context
gathered (from the cache, or its own new tokens without one), padded to the step's longest query
and context, and masked by key validity, causality and the sliding window (two-sided without
causality), in float32 like the reference. Padded query rows are dropped on the way out.

The step's layout (which rows to gather, the mask) is the same in every layer, so it is worked
out once per step (:func:`step_layout`, kept on the step state) and each layer pays one gather
per tensor. A step of equal-length cache-less sequences (an embedding batch) needs no gather
at all: the token stream is already [B, L, H, D].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from portlayer.flatten.op_defs.attention import cache_bytes, visible_keys, write_kv_cache


@dataclass
class StepLayout:
    """Where each sequence's queries and keys sit, padded to [B, Lq] and [B, S] rows."""

    batch: int
    q_len: int  # longest query of the step
    kv_len: int  # longest context of the step
    dense: bool  # equal-length cache-less sequences: the stream reshapes to [B, L, ...] as it is
    q_rows: torch.Tensor | None  # [B * Lq] stream rows (padding repeats a real row; its output is dropped)
    out_rows: torch.Tensor | None  # [T] rows of the padded [B * Lq] output that are real tokens
    kv_rows: torch.Tensor | None  # [B * S] stream rows, or cache slots when paged
    mask: torch.Tensor | None  # [B, 1, Lq, S] bool, None when every key is visible (or is_causal says it)
    is_causal: bool  # the mask is SDPA's own aligned causal one (Lq == S, nothing padded)


def _padded_rows(starts: torch.Tensor, lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] row numbers start_b + min(i, len_b - 1): padding repeats a real row, never reads past it."""
    i = torch.arange(width, device=starts.device)[None, :]
    return starts[:, None] + torch.minimum(i, (lens[:, None] - 1).clamp(min=0))


def step_layout(st: Any, device: torch.device, *, causal: bool, sliding_window: int | None,
                paged: bool) -> StepLayout:
    """The step's layout for these attention attributes on ``device`` (cached on ``st``: layers share it)."""
    key = ("torch_attention_layout", causal, sliding_window, paged, str(device))
    cache = st.__dict__.setdefault("_layouts", {}) if hasattr(st, "__dict__") else {}
    if key not in cache:
        cache[key] = _build_layout(st, device, causal=causal, sliding_window=sliding_window, paged=paged)
    return cache[key]


def _build_layout(st: Any, dev: torch.device, *, causal: bool, sliding_window: int | None, paged: bool) -> StepLayout:
    meta = st.meta
    qsl = meta.query_start_loc.to("cpu", torch.int64)
    lq = qsl[1:] - qsl[:-1]
    b = int(lq.shape[0])
    lq_max = int(lq.max()) if b else 0
    lens = meta.seq_lens.to("cpu", torch.int64) if paged else lq
    s_max = int(lens.max()) if b else 0
    if not paged and b and bool((lq == lq_max).all()):
        if sliding_window:  # aligned positions 0..L-1 in every sequence: one [L, L] mask for all
            pos = torch.arange(lq_max, device=dev)
            mask = visible_keys(pos[:, None], pos[None, :], causal, sliding_window)[None, None]
            return StepLayout(b, lq_max, lq_max, True, None, None, None, mask, False)
        return StepLayout(b, lq_max, lq_max, True, None, None, None, None, causal)
    q_rows = _padded_rows(qsl[:-1], lq, lq_max)
    out_rows = (torch.arange(b)[:, None] * lq_max + torch.arange(lq_max)[None, :])[
        torch.arange(lq_max)[None, :] < lq[:, None]]
    if paged:
        bt = meta.block_tables.to("cpu", torch.int64)
        bs = int(st.kv_caches[0][0].shape[1])
        pos = torch.minimum(torch.arange(s_max)[None, :], (lens[:, None] - 1).clamp(min=0))
        kv_rows = bt.gather(1, pos // bs) * bs + pos % bs
    else:
        kv_rows = _padded_rows(qsl[:-1], lq, s_max)
    qpos = (lens - lq)[:, None] + torch.arange(lq_max)[None, :]
    kpos = torch.arange(s_max)[None, None, :]
    mask = (kpos < lens[:, None, None]) & visible_keys(qpos[:, :, None], kpos, causal, sliding_window)
    return StepLayout(b, lq_max, s_max, False, q_rows.reshape(-1).to(dev), out_rows.to(dev),
                      kv_rows.reshape(-1).to(dev), None if bool(mask.all()) else mask[:, None].to(dev), False)


def _gather(src: torch.Tensor, rows: torch.Tensor, st: Any, name: str) -> torch.Tensor:
    """``src.index_select(0, rows)`` into a buffer the program keeps across layers and steps (grown on
    demand): a fresh tensor of this size (tens of MB at batch 64) is fresh pages from the OS each time,
    and on the CPU the page faults cost ~3x the copy itself (0.6B shape, 64 x 129 rows: 29 vs 8.6 ms).
    A float8 cache is gathered as its bytes (index_select has no float8 kernel on the CPU)."""
    raw = cache_bytes(src)
    if raw is not src:
        return _gather(raw, rows, st, name).view(src.dtype)
    ws = getattr(st, "workspace", None)
    if ws is None:
        return src.index_select(0, rows)
    width = src[0].numel()
    need = rows.numel() * width
    key = f"torch_attention_{name}_{src.dtype}_{src.device}"
    buf = ws.get(key)
    if buf is None or buf.numel() < need:
        ws[key] = buf = torch.empty(max(need, int(1.25 * (buf.numel() if buf is not None else 0))), dtype=src.dtype,
                                    device=src.device)
    out = buf[:need].view(rows.numel(), width)
    torch.index_select(src.reshape(src.shape[0], width), 0, rows, out=out)
    return out.view(rows.numel(), *src.shape[1:])


def attention_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, st: Any, *, layer: int,
                      scale: float | None, causal: bool, sliding_window: int | None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] of one step -> [T, Hq, Dv] (q's dtype)."""
    meta, caches = st.meta, st.kv_caches
    if caches is not None and meta.slot_mapping is not None:
        k_cache, v_cache = caches[layer]
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    paged = caches is not None and meta.block_tables is not None
    lay = step_layout(st, q.device, causal=causal, sliding_window=sliding_window, paged=paged)
    b, lq, s = lay.batch, lay.q_len, lay.kv_len
    if lay.dense:
        qp, kp, vp = (t.reshape(b, lq, *t.shape[1:]) for t in (q, k, v))
    else:
        qp = q.index_select(0, lay.q_rows).view(b, lq, *q.shape[1:])
        if paged:
            k_src, v_src = (c.view(-1, *c.shape[2:]) for c in caches[layer])
        else:
            k_src, v_src = k, v
        kp = _gather(k_src, lay.kv_rows, st, "k").view(b, s, *k_src.shape[1:])
        vp = _gather(v_src, lay.kv_rows, st, "v").view(b, s, *v_src.shape[1:])
    qp, kp, vp = (t.float().transpose(1, 2) for t in (qp, kp, vp))  # [B, H, L, D]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=lay.mask, is_causal=lay.is_causal, scale=scale,
                                         enable_gqa=qp.shape[1] != kp.shape[1])  # [B, Hq, Lq, Dv]
    out = out.transpose(1, 2).reshape(b * lq, out.shape[1], out.shape[3])  # [B * Lq, Hq, Dv]
    if not lay.dense:
        out = out.index_select(0, lay.out_rows)
    return out.to(q.dtype)
