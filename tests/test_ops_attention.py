"""The attention op against SDPA and an explicit masked softmax: causal/bidirectional, GQA,
scale, sliding window, softcap, packed sequences and the paged KV cache."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from portlayer.flatten.ir import TensorType
from portlayer.flatten.op_defs.attention import AttentionMetadata
from portlayer.flatten.ops import get_op

GEN = torch.Generator().manual_seed(1)
ATT = get_op("attention")


def rnd(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def run(q, k, v, ctx=None, **attrs) -> torch.Tensor:
    attrs = ATT.complete_attrs({"num_heads": q.shape[1], "num_kv_heads": k.shape[1], "head_dim": q.shape[2], **attrs})
    (out,) = ATT.reference([q, k, v], attrs, ctx)
    want_t = ATT.infer([TensorType("float32", ("num_tokens", *q.shape[1:])), TensorType("float32", ("num_tokens", *k.shape[1:])),
                        TensorType("float32", ("num_tokens", *v.shape[1:]))], attrs)[0]
    assert tuple(out.shape) == want_t.concrete({"num_tokens": q.shape[0]})
    return out


def sdpa(q, k, v, **kw) -> torch.Tensor:
    """torch SDPA on [L, H, D] tensors (heads moved to the batch position)."""
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), **kw).transpose(0, 1)


def masked_softmax_attention(q, k, v, *, scale, allowed, softcap=None) -> torch.Tensor:
    """Explicit float64 attention; ``allowed[i][j]`` says query i may see key j; kv head of query head h is h // group."""
    group = q.shape[1] // k.shape[1]
    idx = [h // group for h in range(q.shape[1])]
    qd, kd, vd = q.double(), k.double()[:, idx], v.double()[:, idx]
    scores = torch.einsum("lhd,shd->hls", qd, kd) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    mask = torch.tensor(allowed, dtype=torch.bool)
    scores = scores.masked_fill(~mask, -math.inf)
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    p = p / p.sum(-1, keepdim=True)
    return torch.einsum("hls,shd->lhd", p, vd).float()


def causal_allowed(n: int, window: int | None = None) -> list[list[bool]]:
    return [[j <= i and (window is None or i - j < window) for j in range(n)] for i in range(n)]


@pytest.mark.parametrize("causal", [True, False])
def test_vs_sdpa(causal: bool) -> None:
    q, k, v = rnd(7, 4, 16), rnd(7, 4, 16), rnd(7, 4, 16)
    torch.testing.assert_close(run(q, k, v, causal=causal), sdpa(q, k, v, is_causal=causal), atol=1e-5, rtol=1e-5)


def test_scale_and_value_head_dim() -> None:
    q, k, v = rnd(6, 2, 8), rnd(6, 2, 8), rnd(6, 2, 12)
    out = run(q, k, v, scale=0.3, causal=False)
    assert out.shape == (6, 2, 12)
    torch.testing.assert_close(out, sdpa(q, k, v, scale=0.3), atol=1e-5, rtol=1e-5)


def test_gqa_groups_query_heads_onto_kv_heads() -> None:
    q, k, v = rnd(6, 6, 8), rnd(6, 2, 8), rnd(6, 2, 8)
    want = masked_softmax_attention(q, k, v, scale=8**-0.5, allowed=causal_allowed(6))
    torch.testing.assert_close(run(q, k, v), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(run(q, k, v), sdpa(q, k, v, is_causal=True, enable_gqa=True), atol=1e-5, rtol=1e-5)


def test_sliding_window() -> None:
    q, k, v = rnd(9, 2, 8), rnd(9, 2, 8), rnd(9, 2, 8)
    want = masked_softmax_attention(q, k, v, scale=8**-0.5, allowed=causal_allowed(9, window=3))
    torch.testing.assert_close(run(q, k, v, sliding_window=3), want, atol=1e-5, rtol=1e-5)


def test_softcap() -> None:
    q, k, v = rnd(5, 2, 8) * 4, rnd(5, 2, 8) * 4, rnd(5, 2, 8)
    want = masked_softmax_attention(q, k, v, scale=0.25, allowed=causal_allowed(5), softcap=5.0)
    torch.testing.assert_close(run(q, k, v, scale=0.25, softcap=5.0), want, atol=1e-5, rtol=1e-5)


def test_packed_sequences_do_not_see_each_other() -> None:
    q, k, v = rnd(7, 2, 8), rnd(7, 2, 8), rnd(7, 2, 8)
    ctx = SimpleNamespace(attn_metadata=AttentionMetadata.from_lens([3, 4]), kv_cache=None)
    out = run(q, k, v, ctx=ctx)
    torch.testing.assert_close(out[:3], sdpa(q[:3], k[:3], v[:3], is_causal=True), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[3:], sdpa(q[3:], k[3:], v[3:], is_causal=True), atol=1e-5, rtol=1e-5)


def test_paged_kv_cache_matches_dense() -> None:
    """Sequence A has 5 tokens cached and 2 new ones; sequence B is new with 3 tokens.

    The op writes the new k/v through slot_mapping and reads each context through the block
    table; the result must equal dense causal attention over each full sequence.
    """
    hkv, d, bs, nblocks = 2, 8, 4, 8
    qa, ka, va = rnd(7, 4, d), rnd(7, hkv, d), rnd(7, hkv, d)  # A's full 7-token sequence
    qb, kb, vb = rnd(3, 4, d), rnd(3, hkv, d), rnd(3, hkv, d)
    k_cache, v_cache = torch.zeros(nblocks, bs, hkv, d), torch.zeros(nblocks, bs, hkv, d)
    a_slots = [2 * bs + i for i in range(4)] + [5 * bs + i for i in range(3)]  # blocks [2, 5]
    b_slots = [7 * bs + i for i in range(3)]  # block [7]
    for pos in range(5):  # A's cached prefix, written by hand (not through the op)
        blk, off = divmod(a_slots[pos], bs)
        k_cache[blk, off], v_cache[blk, off] = ka[pos], va[pos]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32),
        seq_lens=torch.tensor([7, 3], dtype=torch.int32),
        slot_mapping=torch.tensor(a_slots[5:] + b_slots, dtype=torch.int64),
        block_tables=torch.tensor([[2, 5], [7, 0]], dtype=torch.int32),
        num_prefills=1,
    )
    ctx = SimpleNamespace(attn_metadata=meta, kv_cache=[(k_cache, v_cache)])
    q, k, v = torch.cat([qa[5:], qb]), torch.cat([ka[5:], kb]), torch.cat([va[5:], vb])
    out = run(q, k, v, ctx=ctx, layer=0)
    torch.testing.assert_close(out[:2], sdpa(qa, ka.repeat_interleave(2, 1), va.repeat_interleave(2, 1),
                                             is_causal=True)[5:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[2:], masked_softmax_attention(qb, kb, vb, scale=d**-0.5, allowed=causal_allowed(3)),
                               atol=1e-5, rtol=1e-5)
    for pos, slot in enumerate(a_slots):  # the new tokens landed in the cache, the prefix is intact
        blk, off = divmod(slot, bs)
        assert torch.equal(k_cache[blk, off], ka[pos]) and torch.equal(v_cache[blk, off], va[pos])
    for pos, slot in enumerate(b_slots):
        blk, off = divmod(slot, bs)
        assert torch.equal(k_cache[blk, off], kb[pos])


def test_negative_slots_are_not_written() -> None:
    k_cache, v_cache = torch.zeros(2, 4, 1, 4), torch.zeros(2, 4, 1, 4)
    q, k, v = rnd(2, 1, 4), rnd(2, 1, 4), rnd(2, 1, 4)
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
                             seq_lens=torch.tensor([2], dtype=torch.int32),
                             slot_mapping=torch.tensor([-1, 1]), block_tables=None)
    run(q, k, v, ctx=SimpleNamespace(attn_metadata=meta, kv_cache=[(k_cache, v_cache)]))
    assert torch.equal(k_cache[0, 1], k[1]) and k_cache[0, 0].abs().sum() == 0


def test_infer_rejects_bad_gqa_and_rank() -> None:
    t = lambda *s: TensorType("float32", s)  # noqa: E731
    with pytest.raises(ValueError, match="multiple"):
        ATT.infer([t("num_tokens", 6, 8), t("num_tokens", 4, 8), t("num_tokens", 4, 8)], ATT.complete_attrs({}))
    with pytest.raises(ValueError, match="tokens, heads, head_dim"):
        ATT.infer([t("num_tokens", 48), t("num_tokens", 4, 8), t("num_tokens", 4, 8)], ATT.complete_attrs({}))
