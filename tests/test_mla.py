"""Multi-head latent attention (flatten/op_defs/mla.py) against an independent dense reference:
per-head keys and values expanded from the latent with torch ops, then torch's
scaled_dot_product_attention. One paged step mixes a prefill chunk over cached context and
decodes (weight absorption); the cache holds exactly latent ++ k_pe per token."""

from __future__ import annotations

import torch

from portlayer.flatten.interpret import ExecContext
from portlayer.flatten.op_defs.attention import AttentionMetadata
from portlayer.flatten.ops import get_op
from portlayer.runtime.kv_cache import KVCacheSpec

H, DN, DR, DV, R, BS = 4, 16, 8, 12, 20, 4


def _dense(q, lat, pe, w, ctx_len):
    """Expanded MLA of one sequence: q [L, H, DN+DR] at positions ctx_len-L .. ctx_len-1."""
    wf = w.view(H, DN + DV, R)
    k = torch.cat([torch.einsum("sr,hdr->hsd", lat, wf[:, :DN]), pe[None].expand(H, -1, -1)], dim=-1)
    v = torch.einsum("sr,hdr->hsd", lat, wf[:, DN:])
    lq = q.shape[0]
    mask = torch.arange(ctx_len)[None, :] <= torch.arange(ctx_len - lq, ctx_len)[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=0.3)
    return o.transpose(0, 1)


def test_paged_mla_step_matches_expanded_attention():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(H * (DN + DV), R, generator=g) / R**0.5
    # sequence 0: 6 cached + a 3-token prefill chunk; sequences 1, 2: 9 and 1 cached + one decode token
    seqs = [(6, 3), (9, 1), (1, 1)]
    full = [(torch.randn(c + n, R, generator=g), torch.randn(c + n, DR, generator=g)) for c, n in seqs]
    qs = [torch.randn(n, H, DN + DR, generator=g) for _, n in seqs]
    cache = torch.zeros(16, BS, 1, R + DR)
    free = torch.randperm(16, generator=g).tolist()
    tables, slots, lat_new, pe_new = [], [], [], []
    for (c, n), (lat, pe) in zip(seqs, full):
        blocks = [free.pop() for _ in range(-(-(c + n) // BS))]
        tables.append(blocks + [0] * (4 - len(blocks)))
        for p in range(c + n):
            slot = blocks[p // BS] * BS + p % BS
            if p < c:
                cache.view(-1, R + DR)[slot] = torch.cat([lat[p], pe[p]])
            else:
                slots.append(slot)
        lat_new.append(lat[c:])
        pe_new.append(pe[c:])
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 3, 4, 5], dtype=torch.int32),
                             seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
                             slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
                             num_prefills=1, max_query_len=3, max_seq_len=10)
    ctx = ExecContext(bindings={"num_tokens": 5}, attn_metadata=meta, kv_cache=[(cache, torch.zeros(16, BS, 1, 0))])
    attrs = {"num_heads": H, "kv_lora_rank": R, "qk_nope_head_dim": DN, "qk_rope_head_dim": DR, "v_head_dim": DV,
             "scale": 0.3, "layer": 0}
    (out,) = get_op("mla_attention").reference([torch.cat(qs), torch.cat(lat_new), torch.cat(pe_new), w], attrs, ctx)
    want = torch.cat([_dense(q, lat, pe, w, c + n) for q, (lat, pe), (c, n) in zip(qs, full, seqs)])
    assert out.shape == (5, H, DV)
    assert (out - want).abs().max().item() <= 1e-5
    for (c, n), (lat, pe), t in zip(seqs, full, [tables[0], tables[1], tables[2]]):  # the cache holds c ++ k_pe
        rows = cache[torch.tensor(t)].reshape(-1, R + DR)[: c + n]
        assert torch.equal(rows, torch.cat([lat, pe], dim=-1))


def test_latent_cache_block_counts_rank_plus_rope():
    meta = {"num_layers": 3, "num_kv_heads": 1, "head_dim": R + DR, "v_head_dim": 0, "kv_layout": "mla_latent"}
    spec = KVCacheSpec.from_meta(meta, 16, torch.float32)
    assert spec.value_dim == 0 and spec.bytes_per_block == 3 * 16 * (R + DR) * 4
