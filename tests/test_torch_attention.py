"""codegen/torch_attention.py (the CPU's batched attention) against a per-sequence softmax written
here: cache-less steps of equal and mixed lengths, causal, bidirectional and sliding windows, GQA,
and paged steps mixing a prefill with decodes through a block table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from portlayer.codegen.torch_attention import attention_batched
from portlayer.flatten.op_defs.attention import AttentionMetadata


def _expected_one(q, k, v, *, scale, causal, window):
    """q [Lq, Hq, D] against k/v [S, Hkv, D]; the queries are the last Lq positions of the S."""
    lq, s, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    qpos = torch.arange(s - lq, s)[:, None]
    kpos = torch.arange(s)[None, :]
    keep = torch.ones(lq, s, dtype=torch.bool)
    if causal:
        keep &= kpos <= qpos
    if window:
        keep &= kpos > qpos - window
        if not causal:
            keep &= kpos < qpos + window
    logits = logits.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", logits.softmax(-1), v.double()).float()


def _state(meta, caches=None):
    return SimpleNamespace(meta=meta, kv_caches=caches)  # what calibrate passes: no device (q's is used)


CASES = [  # (lengths, causal, sliding window)
    ([7, 7, 7], False, None), ([5, 5], True, None), ([6, 6], False, 3), ([6, 6, 6], True, 2),
    ([3, 9, 1, 6], False, None), ([3, 9, 1, 6], True, None), ([4, 10, 2], False, 3), ([4, 10, 2], True, 4),
]


@pytest.mark.parametrize(("lens", "causal", "window"), CASES)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_cacheless_steps_match_each_sequence_alone(lens, causal, window, heads):
    torch.manual_seed(sum(lens) + causal)
    hq, hkv = heads
    t = sum(lens)
    q, k, v = torch.randn(t, hq, 8), torch.randn(t, hkv, 8), torch.randn(t, hkv, 8)
    st = _state(AttentionMetadata.from_lens(lens))
    out = attention_batched(q, k, v, st, layer=0, scale=0.3, causal=causal, sliding_window=window)
    again = attention_batched(q, k, v, st, layer=1, scale=0.3, causal=causal, sliding_window=window)  # cached layout
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    want = torch.cat([_expected_one(q[a:b], k[a:b], v[a:b], scale=0.3, causal=causal, window=window)
                      for a, b in zip(starts[:-1], starts[1:])])
    assert out.shape == (t, hq, 8)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, out, rtol=0, atol=0)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_step_with_a_prefill_and_decodes_reads_the_cache(window):
    torch.manual_seed(3)
    bs, hq, hkv, d = 4, 4, 2, 8
    blocks = torch.zeros(8, bs, hkv, d), torch.zeros(8, bs, hkv, d)
    # sequence 0 decodes its 10th token (9 cached), 1 prefills 6 tokens, 2 decodes its 3rd token (2 cached)
    hist = {0: (torch.randn(9, hkv, d), torch.randn(9, hkv, d)), 2: (torch.randn(2, hkv, d), torch.randn(2, hkv, d))}
    tables = torch.tensor([[5, 1, 7], [0, 2, 0], [6, 0, 0]], dtype=torch.int32)
    for b, (hk, hv) in hist.items():
        for p in range(hk.shape[0]):
            blk, off = int(tables[b, p // bs]), p % bs
            blocks[0][blk, off], blocks[1][blk, off] = hk[p], hv[p]
    lens = [6, 10, 3]  # new tokens 6, 1, 1: the prefill first, as the scheduler orders them
    order = [1, 0, 2]
    q, k, v = torch.randn(8, hq, d), torch.randn(8, hkv, d), torch.randn(8, hkv, d)
    slots = [int(tables[1, p // bs]) * bs + p % bs for p in range(6)]
    slots += [int(tables[0, 9 // bs]) * bs + 9 % bs, int(tables[2, 0]) * bs + 2]
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 6, 7, 8], dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             slot_mapping=torch.tensor(slots, dtype=torch.int64),
                             block_tables=tables[order].contiguous(), num_prefills=1, max_query_len=6, max_seq_len=10)
    out = attention_batched(q, k, v, _state(meta, [blocks]), layer=0, scale=None, causal=True, sliding_window=window)
    scale = d**-0.5
    want = [_expected_one(q[:6], k[:6], v[:6], scale=scale, causal=True, window=window)]
    for row, b in ((6, 0), (7, 2)):
        ck = torch.cat([hist[b][0], k[row:row + 1]])
        cv = torch.cat([hist[b][1], v[row:row + 1]])
        want.append(_expected_one(q[row:row + 1], ck, cv, scale=scale, causal=True, window=window))
    torch.testing.assert_close(out, torch.cat(want), rtol=1e-5, atol=1e-5)
