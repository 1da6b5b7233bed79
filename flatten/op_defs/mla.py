"""Multi-head latent attention (DeepSeek-V2/V3): attention whose paged KV cache holds one
compressed latent per token instead of per-head keys and values.

Per token the cache stores ``latent ++ k_pe`` (kv_lora_rank + qk_rope_head_dim values, one
"head"), written at ``slot_mapping`` into the layer's key cache; the value cache has width 0.
Keys and values are linear in the latent through ``w_kv_b`` ([H * (nope + v), rank], HF's
``kv_b_proj``): head h's key is ``[W_UK[h] @ c ++ k_pe]``, its value ``W_UV[h] @ c``.

- Prefill (a sequence with several new tokens, or no cache): plain expansion, K and V of every
  context token computed from the latents, then ordinary causal attention.
- Decode (one new token): weight absorption, nothing expanded: q_lat[h] = q_nope[h] @ W_UK[h]
  ([rank]), scores = q_lat . c_j + q_pe . k_pe_j, o_lat = sum_j p_j c_j, out[h] = W_UV[h] @ o_lat.

Both are the same function of the inputs (float32 math); capture raises this op only where
the model's expanded graph is proven equal to it (flatten/mla_pattern.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from portlayer.flatten.ir import TensorType, eval_dim
from portlayer.flatten.op_defs.attention import AttentionMetadata, attention_reference, cache_bytes
from portlayer.flatten.ops import op


def _mla_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    q, lat, pe, w = ins
    h, dn, dr, dv, r = (int(a[k]) for k in ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                            "kv_lora_rank"))
    if q.rank != 3 or lat.rank != 2 or pe.rank != 2 or w.rank != 2:
        raise ValueError(f"mla_attention wants q [T, H, nope+rope], latent [T, rank], k_pe [T, rope], "
                         f"w_kv_b [H*(nope+v), rank]; got {q}, {lat}, {pe}, {w}")
    want = ((q.shape[1], q.shape[2]), lat.shape[1], pe.shape[1], tuple(w.shape))
    if want != ((h, dn + dr), r, dr, (h * (dn + dv), r)):
        raise ValueError(f"mla_attention: shapes {q}, {lat}, {pe}, {w} do not fit heads {h}, nope {dn}, rope {dr}, "
                         f"v {dv}, rank {r}")
    return [TensorType(q.dtype, (q.shape[0], h, dv))]


def _mla_flops(ins, outs, a, b) -> int:
    t = eval_dim(ins[0].shape[0], b)
    h, dn, dr, dv = (int(a[k]) for k in ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    expand = 2 * t * h * (dn + dv) * int(a["kv_lora_rank"])
    return int(expand + 2 * t * (t + 1) / 2 * h * (dn + dr + dv))


def cache_entry(latent: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """What one token leaves in the cache: [T, 1, rank + rope]."""
    return torch.cat([latent, k_pe], dim=-1)[:, None, :]


def _expand(entries: torch.Tensor, w: torch.Tensor, h: int, dn: int, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached entries [S, rank + rope] -> per-head keys [S, H, nope + rope] and values [S, H, v]."""
    r = w.shape[1]
    kv = (entries[:, :r].float() @ w.float().t()).view(-1, h, dn + dv)
    pe = entries[:, None, r:].float().expand(-1, h, -1)
    return torch.cat([kv[..., :dn], pe], dim=-1), kv[..., dn:]


def _absorbed(q: torch.Tensor, entries: torch.Tensor, w: torch.Tensor, h: int, dn: int, dv: int,
              scale: float) -> torch.Tensor:
    """One query token q [H, nope + rope] against cached entries [S, rank + rope], nothing expanded."""
    r = w.shape[1]
    wf = w.float().view(h, dn + dv, r)
    q_lat = torch.einsum("hd,hdr->hr", q[:, :dn].float(), wf[:, :dn])
    ef = entries.float()
    scores = (q_lat @ ef[:, :r].t() + q[:, dn:].float() @ ef[:, r:].t()) * scale
    o_lat = torch.softmax(scores, dim=-1) @ ef[:, :r]
    return torch.einsum("hr,hvr->hv", o_lat, wf[:, dn:])


@op(
    "mla_attention",
    kind="attention",
    inputs=("q", "latent", "k_pe", "w_kv_b"),
    attrs={"num_heads": 1, "kv_lora_rank": 1, "qk_nope_head_dim": 1, "qk_rope_head_dim": 1, "v_head_dim": 1,
           "scale": None, "layer": 0},
    infer=_mla_infer,
    flops=_mla_flops,
    needs_context=True,
)
def mla_attention(q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, w_kv_b: torch.Tensor,
                  num_heads: int = 1, kv_lora_rank: int = 1, qk_nope_head_dim: int = 1, qk_rope_head_dim: int = 1,
                  v_head_dim: int = 1, scale: float | None = None, layer: int = 0, ctx: Any = None) -> torch.Tensor:
    """Causal MLA over the flattened token stream: expansion for prefill, absorption for decode."""
    h, dn, dv = int(num_heads), int(qk_nope_head_dim), int(v_head_dim)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    meta: AttentionMetadata | None = getattr(ctx, "attn_metadata", None)
    if meta is None:
        meta = AttentionMetadata.single(q.shape[0], device=q.device)
    caches = getattr(ctx, "kv_cache", None)
    new = cache_entry(latent, k_pe)
    paged = caches is not None and meta.block_tables is not None
    if caches is not None and meta.slot_mapping is not None:
        k_cache = caches[layer][0]
        slots = meta.slot_mapping.long()
        keep = slots >= 0
        cache_bytes(k_cache.view(-1, *k_cache.shape[2:])).index_copy_(0, slots[keep], cache_bytes(new[keep].to(k_cache.dtype)))
    out = torch.empty(q.shape[0], h, dv, dtype=q.dtype, device=q.device)
    starts = meta.query_start_loc.tolist()
    for b, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
        if e == s:
            continue
        if paged:
            k_cache = caches[layer][0]
            seq_len = int(meta.seq_lens[b])
            bs = k_cache.shape[1]
            ids = meta.block_tables[b][: (seq_len + bs - 1) // bs].long()
            entries = cache_bytes(k_cache)[ids].view(k_cache.dtype).reshape(-1, k_cache.shape[-1])[:seq_len]
            if entries.dtype.itemsize == 1:  # a float8 cache: its rounded values, in the compute dtype
                entries = entries.to(q.dtype)
        else:
            seq_len, entries = e - s, new[s:e, 0]
        if e - s == 1 and seq_len > 1:
            out[s] = _absorbed(q[s], entries, w_kv_b, h, dn, dv, scale).to(q.dtype)
            continue
        kk, vv = _expand(entries, w_kv_b, h, dn, dv)
        q_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device)
        out[s:e] = attention_reference(q[s:e], kk, vv, scale=scale, causal=True, sliding_window=None, softcap=None,
                                       q_pos=q_pos)
    return out
