"""The attention op: the one op that sees sequence boundaries and the paged KV cache.

Inputs are per-token q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] of the flattened token
stream. Sequence structure arrives at run time through :class:`AttentionMetadata`; the
paged cache through the execution context's ``kv_cache`` (one (key, value) pair of
``[num_blocks, block_size, Hkv, D]`` tensors per layer). The reference implementation
below is the semantics every backend kernel is checked against; with a cache present it
really writes through ``slot_mapping`` and reads back through ``block_tables``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from portlayer.flatten.ir import TensorType
from portlayer.flatten.ops import op


@dataclass
class AttentionMetadata:
    """Per-step sequence layout of the token stream (built by the runtime each step).

    query_start_loc: int32 [B+1], cumulative new-token counts (sequence b owns stream rows
        query_start_loc[b]:query_start_loc[b+1]).
    seq_lens: int32 [B], context length of each sequence after this step (cached + new).
    slot_mapping: int64 [T], the cache slot (block * block_size + offset) for each token's
        k/v; negative slots are not written. None when no cache is used.
    block_tables: int32 [B, max_blocks], physical block ids per sequence.
    num_prefills: sequences with more than one new token come first (the prefill/decode split).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    num_prefills: int = 0
    max_query_len: int = 0
    max_seq_len: int = 0

    @staticmethod
    def single(num_tokens: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """One sequence spanning the whole stream, no cache: what the interpreter defaults to."""
        return AttentionMetadata.from_lens([num_tokens], device=device)

    @staticmethod
    def from_lens(lens: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
        """Several cache-less sequences packed into one stream, in order."""
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            num_prefills=sum(1 for n in lens if n > 1),
            max_query_len=max(lens, default=0),
            max_seq_len=max(lens, default=0),
        )


def _attn_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    q, k, v = ins[0], ins[1], ins[2]
    if q.rank != 3 or k.rank != 3 or v.rank != 3:
        raise ValueError(f"attention wants q/k/v as [tokens, heads, head_dim]; got {q}, {k}, {v}")
    hq, hkv = q.shape[1], k.shape[1]
    if isinstance(hq, int) and isinstance(hkv, int) and hq % hkv:
        raise ValueError(f"attention: {hq} query heads are not a multiple of {hkv} kv heads")
    return [TensorType(q.dtype, (q.shape[0], q.shape[1], v.shape[2]))]


def _attn_flops(ins, outs, a, b) -> int:
    # Counted for a self-contained sequence of T tokens (a prefill); decode context is
    # not in the types, so the cost model treats it as the new tokens only.
    from portlayer.flatten.ir import eval_dim

    t = eval_dim(ins[0].shape[0], b)
    h = int(ins[0].shape[1])
    d = int(ins[0].shape[2])
    span = t if not a.get("causal", True) else (t + 1) / 2
    return int(4 * t * span * h * d)


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, sliding_window: int | None) -> torch.Tensor:
    """Which keys each query sees (broadcast of ``q_pos`` against ``k_pos``): causal keeps k <= q; a
    sliding window w keeps the last w positions, or, without causality, |q - k| < w."""
    mask = torch.ones(torch.broadcast_shapes(q_pos.shape, k_pos.shape), dtype=torch.bool, device=q_pos.device)
    if causal:
        mask &= k_pos <= q_pos
    if sliding_window:
        mask &= k_pos > q_pos - sliding_window
        if not causal:
            mask &= k_pos < q_pos + sliding_window
    return mask


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
    q_pos: torch.Tensor,
) -> torch.Tensor:
    """Dense attention of one sequence: q [L, Hq, D] at positions ``q_pos`` against k/v
    [S, Hkv, D] at positions 0..S-1. float32 math, output in q's dtype.

    ``sliding_window`` w keeps keys with q - k < w; without ``causal`` it is two-sided,
    |q - k| < w (ModernBERT-style local attention)."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf, kf, vf = q.float(), k.float(), v.float()
    if group > 1:
        kf = kf.repeat_interleave(group, dim=1)
        vf = vf.repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", qf, kf) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    kpos = torch.arange(k.shape[0], device=q.device)
    mask = visible_keys(q_pos[:, None], kpos[None, :], causal, sliding_window)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)
    return torch.einsum("hls,shd->lhd", probs, vf).to(q.dtype)


@op(
    "attention",
    kind="attention",
    inputs=("q", "k", "v"),
    attrs={
        "num_heads": 1,
        "num_kv_heads": 1,
        "head_dim": 1,
        "scale": None,
        "causal": True,
        "sliding_window": None,
        "softcap": None,
        "layer": 0,
    },
    infer=_attn_infer,
    flops=_attn_flops,
    needs_context=True,
)
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_heads: int = 1,
    num_kv_heads: int = 1,
    head_dim: int = 1,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    layer: int = 0,
    ctx: Any = None,
) -> torch.Tensor:
    """Scaled dot-product attention over the flattened token stream (GQA by head groups).

    Without a KV cache every sequence attends within its own new tokens. With one, the
    new k/v are written to the layer's paged cache at ``slot_mapping`` and each sequence
    attends over its first ``seq_lens[b]`` cached tokens gathered via ``block_tables``;
    its new tokens sit at the end of that context.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    meta: AttentionMetadata | None = getattr(ctx, "attn_metadata", None)
    if meta is None:
        meta = AttentionMetadata.single(q.shape[0], device=q.device)
    caches = getattr(ctx, "kv_cache", None)
    starts = meta.query_start_loc.tolist()
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    if caches is not None and meta.slot_mapping is not None:
        k_cache, v_cache = caches[layer]
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    for b, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
        if e == s:
            continue
        if caches is not None and meta.block_tables is not None:
            k_cache, v_cache = caches[layer]
            seq_len = int(meta.seq_lens[b])
            kk, vv = read_kv_cache(k_cache, v_cache, meta.block_tables[b], seq_len)
        else:
            seq_len = e - s
            kk, vv = k[s:e], v[s:e]
        q_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device)
        out[s:e] = attention_reference(
            q[s:e], kk, vv, scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap, q_pos=q_pos
        )
    return out


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter per-token k/v into [num_blocks, block_size, H, D] caches; negative slots skip."""
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    kc = k_cache.view(-1, *k_cache.shape[2:])  # a view: writes land in the cache (fails loudly if not contiguous)
    vc = v_cache.view(-1, *v_cache.shape[2:])
    # torch rounds to a float8 cache to nearest (ties to even) and saturates at its largest finite value: the bytes
    # the generated kernels store too (codegen/templates/triton/_kv_cache.j2)
    cache_bytes(kc).index_copy_(0, slots, cache_bytes(k[keep].to(k_cache.dtype)))
    cache_bytes(vc).index_copy_(0, slots, cache_bytes(v[keep].to(v_cache.dtype)))


def cache_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes: index_copy_ / indexing have no float8 kernels on the CPU."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


def read_kv_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the first ``seq_len`` cached tokens of one sequence through its block table."""
    block_size = k_cache.shape[1]
    nblocks = (seq_len + block_size - 1) // block_size
    ids = block_table[:nblocks].long()
    kk = cache_bytes(k_cache)[ids].view(k_cache.dtype).reshape(-1, *k_cache.shape[2:])[:seq_len]
    vv = cache_bytes(v_cache)[ids].view(v_cache.dtype).reshape(-1, *v_cache.shape[2:])[:seq_len]
    return kk, vv
