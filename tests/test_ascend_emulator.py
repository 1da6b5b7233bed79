"""The CPU emulator of torch_npu calls (backends/ascend_emulator.py): each op against an
independent torch formula, and its documented rejections (ascend-ops.md). Emulation only:
nothing here ran on an Ascend NPU."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from portlayer.backends.ascend_emulator import AscendEmulator, causal_mask_2048


@pytest.fixture
def npu():
    return AscendEmulator()


def rnd(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# ---- §1 / §2 norms --------------------------------------------------------------------------------


def test_rms_norm_formula_and_rstd_shape(npu):
    x, w = rnd(4, 3, 16), rnd(16, seed=1)
    y, rstd = npu.npu_rms_norm(x, w, 1e-6)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(y, ref)
    assert rstd.dtype == torch.float32 and rstd.shape == (4, 3, 1)
    y2, rstd2 = npu.npu_rms_norm(x, rnd(3, 16, seed=2))  # two trailing axes
    assert rstd2.shape == (4, 1, 1) and y2.shape == x.shape


def test_rms_norm_half_returns_input_dtype(npu):
    x, w = rnd(5, 32, dtype=torch.float16), rnd(32, dtype=torch.float32, seed=1)
    y, _ = npu.npu_rms_norm(x, w)
    assert y.dtype == torch.float16
    ref = x.float() / torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=1e-2)


def test_rms_norm_rejections(npu):
    with pytest.raises(RuntimeError, match="trailing dims"):
        npu.npu_rms_norm(rnd(4, 16), rnd(8))
    with pytest.raises(RuntimeError, match="gamma.dim"):
        npu.npu_rms_norm(rnd(16), rnd(2, 16))
    with pytest.raises(RuntimeError, match="561002"):  # (fp32, fp16) is not an A2 pair
        npu.npu_rms_norm(rnd(4, 16), rnd(16, dtype=torch.float16))


def test_add_rms_norm_outputs_in_order(npu):
    a, b, w = rnd(6, 16), rnd(6, 16, seed=1), rnd(16, seed=2)
    y, rstd, s = npu.npu_add_rms_norm(a, b, w, 1e-5)
    torch.testing.assert_close(s, a + b)
    torch.testing.assert_close(y, (a + b) * torch.rsqrt((a + b).pow(2).mean(-1, keepdim=True) + 1e-5) * w)
    assert rstd.dtype == torch.float32


def test_add_rms_norm_rejections(npu):
    with pytest.raises(RuntimeError, match="share one dtype"):
        npu.npu_add_rms_norm(rnd(2, 16, dtype=torch.float16), rnd(2, 16, dtype=torch.float16), rnd(16))
    with pytest.raises(RuntimeError, match="empty"):
        npu.npu_add_rms_norm(rnd(0, 16), rnd(0, 16), rnd(16))


# ---- §3 rope ----------------------------------------------------------------------------------------


def table(max_pos=64, rot=16, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rot, 2).float() / rot)
    f = torch.arange(max_pos).float()[:, None] * inv[None]
    return torch.cat((f.cos(), f.sin()), dim=-1)  # [max_pos, rot], cos half first


def hf_rope(x, pos, cache, neox):
    """HF's rotate_half (neox) / GPT-J interleave, written independently."""
    rot = cache.shape[-1]
    cos, sin = cache[pos, : rot // 2][:, None], cache[pos, rot // 2:][:, None]
    if neox:
        c, s = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        x1, x2 = x[..., : rot // 2], x[..., rot // 2: rot]
        return torch.cat((x[..., :rot] * c + torch.cat((-x2, x1), -1) * s, x[..., rot:]), -1)
    c, s = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    xr = x[..., :rot]
    rh = torch.stack((-xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2)
    return torch.cat((xr * c + rh * s, x[..., rot:]), -1)


@pytest.mark.parametrize("neox", [True, False])
def test_mrope_matches_hf(npu, neox):
    pos = torch.tensor([0, 3, 7, 63, 5])
    q, k, cache = rnd(5, 4, 32), rnd(5, 2, 32, seed=1), table(rot=32)
    q2, k2 = npu.npu_mrope(pos, q.reshape(5, -1), k.reshape(5, -1), cache, 32, mrope_section=[0, 0, 0],
                           rotary_mode="half" if neox else "interleave")
    torch.testing.assert_close(q2.view(5, 4, 32), hf_rope(q, pos, cache, neox))
    torch.testing.assert_close(k2.view(5, 2, 32), hf_rope(k, pos, cache, neox))


def test_mrope_rejections(npu):
    pos, cache = torch.tensor([0, 1]), table(rot=32)
    q, k = rnd(2, 64), rnd(2, 32)
    with pytest.raises(RuntimeError, match="'half' or 'interleave'"):  # vllm-ascend HEAD's "interleaved" (unconfirmed)
        npu.npu_mrope(pos, q, k, cache, 32, rotary_mode="interleaved")
    with pytest.raises(RuntimeError, match="multiples of 32"):
        npu.npu_mrope(pos, q.half(), k.half(), table(rot=16).half(), 16)


def test_rotary_embedding_in_place_and_first_table_quirk(npu):
    pos = torch.tensor([1, 2, 9])
    q, k, cache = rnd(3, 2, 16), rnd(3, 1, 16, seed=1), table()
    q2, k2 = q.reshape(3, -1).clone(), k.reshape(3, -1).clone()
    assert npu._npu_rotary_embedding(pos, q2, k2, 16, cache, True) is None
    torch.testing.assert_close(q2.view(3, 2, 16), hf_rope(q, pos, cache, True))
    torch.testing.assert_close(k2.view(3, 1, 16), hf_rope(k, pos, cache, True))
    q3 = q.reshape(3, -1).clone()  # ATB keeps the FIRST table in a C++ static: a second table is ignored
    npu._npu_rotary_embedding(pos, q3, k.reshape(3, -1).clone(), 16, table(base=10.0), True)
    torch.testing.assert_close(q3, q2)


def test_rotary_embedding_rejections(npu):
    with pytest.raises(RuntimeError, match="2-D"):
        npu._npu_rotary_embedding(torch.tensor([0]), rnd(1, 2, 16), rnd(1, 16), 16, table(), True)
    with pytest.raises(RuntimeError, match="head_size"):
        npu._npu_rotary_embedding(torch.tensor([0]), rnd(1, 30), rnd(1, 16), 16, table(), True)


def test_rotary_mul(npu):
    x = rnd(1, 3, 2, 16)
    pos = torch.tensor([0, 4, 8])
    c = table()
    cos = torch.cat((c[pos, :8], c[pos, :8]), -1)[None, :, None]
    sin = torch.cat((c[pos, 8:], c[pos, 8:]), -1)[None, :, None]
    torch.testing.assert_close(npu.npu_rotary_mul(x, cos, sin), hf_rope(x[0], pos, c, True)[None])
    with pytest.raises(RuntimeError, match="rotary_mode"):
        npu.npu_rotary_mul(x, cos, sin, rotary_mode="quarter")


# ---- §4 swiglu --------------------------------------------------------------------------------------


def test_swiglu_gate_is_first_half(npu):
    x = rnd(3, 8)
    torch.testing.assert_close(npu.npu_swiglu(x), F.silu(x[:, :4]) * x[:, 4:])
    h = x.half()
    assert npu.npu_swiglu(h).dtype == torch.float16
    with pytest.raises(RuntimeError, match="must be even"):
        npu.npu_swiglu(rnd(3, 7))
    with pytest.raises(RuntimeError, match="contiguous"):
        npu.npu_swiglu(rnd(8, 4).t())


# ---- §5 cache writes --------------------------------------------------------------------------------


def caches(nb=4, bs=16, nkv=2, d=8, dtype=torch.float16):
    return torch.zeros(nb, bs, nkv, d, dtype=dtype), torch.zeros(nb, bs, nkv, d, dtype=dtype)


@pytest.mark.parametrize("api", ["npu_scatter_pa_kv_cache", "_npu_reshape_and_cache"])
def test_cache_write_slots(npu, api):
    kc, vc = caches()
    k, v = rnd(3, 2, 8, dtype=torch.float16), rnd(3, 2, 8, dtype=torch.float16, seed=1)
    slots = torch.tensor([0, 17, 63], dtype=torch.int32)
    if api == "npu_scatter_pa_kv_cache":
        npu.npu_scatter_pa_kv_cache(key=k, value=v, key_cache=kc, value_cache=vc, slot_mapping=slots, cache_mode="Norm")
    else:
        npu._npu_reshape_and_cache(key=k, value=v, key_cache=kc, value_cache=vc, slot_indices=slots)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(kc[s // 16, s % 16], k[i]) and torch.equal(vc[s // 16, s % 16], v[i])
    assert int((kc != 0).any(-1).any(-1).sum()) == 3


def test_cache_write_rejections(npu):
    kc, vc = caches()
    k = rnd(2, 2, 8, dtype=torch.float16)
    kw = dict(key=k, value=k, key_cache=kc, value_cache=vc)
    with pytest.raises(RuntimeError, match="duplicates"):
        npu.npu_scatter_pa_kv_cache(**kw, slot_mapping=torch.tensor([3, 3], dtype=torch.int32), cache_mode="Norm")
    with pytest.raises(RuntimeError, match=r"\[0, 63\]"):
        npu.npu_scatter_pa_kv_cache(**kw, slot_mapping=torch.tensor([3, 64], dtype=torch.int32), cache_mode="Norm")
    with pytest.raises(RuntimeError, match="not emulated"):  # default PA_NZ layout
        npu.npu_scatter_pa_kv_cache(**kw, slot_mapping=torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int32"):
        npu._npu_reshape_and_cache(**kw, slot_indices=torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="unconfirmed"):  # negative slots: refused (conservative)
        npu._npu_reshape_and_cache(**kw, slot_indices=torch.tensor([1, -1], dtype=torch.int32))
    k32 = rnd(2, 2, 8)
    with pytest.raises(RuntimeError, match="one dtype"):
        npu._npu_reshape_and_cache(key=k32, value=k32, key_cache=kc.float(), value_cache=vc.float(),
                                   slot_indices=torch.tensor([1, 2], dtype=torch.int32))


# ---- attention: an independent dense formula ----------------------------------------------------------


def dense(q, k, v, scale, q_offset):
    """softmax(scale * q k^T) v per head with GQA, query i at absolute position q_offset + i."""
    n, nkv = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(n // nkv, 1)
    v = v.float().repeat_interleave(n // nkv, 1)
    s = torch.einsum("ihd,jhd->hij", q.float(), k) * scale
    i = torch.arange(q.shape[0])[:, None] + q_offset
    j = torch.arange(k.shape[0])[None]
    s = s.masked_fill(j > i, float("-inf"))
    return torch.einsum("hij,jhd->ihd", s.softmax(-1), v)


def paged(seqs, bs=128, nkv=2, d=64, dtype=torch.float16, seed=0):
    """Write per-sequence contexts [len, nkv, d] into a shuffled block layout."""
    nb = sum(-(-len_ // bs) for len_ in seqs) + 2
    kc, vc = torch.zeros(nb, bs, nkv, d, dtype=dtype), torch.zeros(nb, bs, nkv, d, dtype=dtype)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(-(-len_ // bs) for len_ in seqs)
    table, ks, vs = [], [], []
    for i, n in enumerate(seqs):
        k, v = rnd(n, nkv, d, dtype=dtype, seed=10 + i), rnd(n, nkv, d, dtype=dtype, seed=50 + i)
        ids = [perm.pop() for _ in range(-(-n // bs))]
        for t in range(n):
            kc[ids[t // bs], t % bs], vc[ids[t // bs], t % bs] = k[t], v[t]
        table.append(ids + [0] * (width - len(ids)))
        ks.append(k)
        vs.append(v)
    return kc, vc, torch.tensor(table, dtype=torch.int32), ks, vs


def test_paged_attention_decode(npu):
    lens = [1, 130, 300]
    kc, vc, bt, ks, vs = paged(lens)
    q = rnd(3, 4, 64, dtype=torch.float16, seed=3)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(64)
    npu._npu_paged_attention(query=q, key_cache=kc, value_cache=vc, num_kv_heads=2, num_heads=4, scale_value=scale,
                             block_table=bt, context_lens=torch.tensor(lens, dtype=torch.int32), out=out)
    for i, n in enumerate(lens):
        torch.testing.assert_close(out[i].float(), dense(q[i:i + 1], ks[i], vs[i], scale, n - 1)[0], atol=2e-3, rtol=2e-3)


def test_paged_attention_rejections(npu):
    kc, vc, bt, _, _ = paged([5])
    q = rnd(1, 4, 64, dtype=torch.float16)
    kw = dict(query=q, key_cache=kc, value_cache=vc, num_kv_heads=2, num_heads=4, scale_value=0.1, block_table=bt,
              out=torch.empty_like(q))
    with pytest.raises(RuntimeError, match="int32"):
        npu._npu_paged_attention(**kw, context_lens=torch.tensor([5]))
    with pytest.raises(RuntimeError, match="fp16/bf16"):
        npu._npu_paged_attention(**{**kw, "query": q.float(), "out": q.float()}, context_lens=torch.tensor([5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="num_heads"):
        npu._npu_paged_attention(**{**kw, "num_kv_heads": 3}, context_lens=torch.tensor([5], dtype=torch.int32))
    odd = torch.zeros(2, 24, 2, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        npu._npu_paged_attention(**{**kw, "key_cache": odd, "value_cache": odd}, context_lens=torch.tensor([5], dtype=torch.int32))
    big = torch.zeros(2, 16, 2, 320, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="head_size"):
        npu._npu_paged_attention(query=torch.zeros(1, 4, 320, dtype=torch.float16), key_cache=big, value_cache=big,
                                 num_kv_heads=2, num_heads=4, scale_value=0.1, block_table=torch.zeros(1, 1, dtype=torch.int32),
                                 context_lens=torch.tensor([5], dtype=torch.int32), out=torch.zeros(1, 4, 320, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="max_blocks"):
        npu._npu_paged_attention(**kw, context_lens=torch.tensor([200], dtype=torch.int32))


def fia_kwargs(**kw):
    base = dict(num_heads=4, num_key_value_heads=2, scale=1 / 8, input_layout="TND", sparse_mode=3,
                atten_mask=causal_mask_2048())
    base.update(kw)
    return base


def test_fia_tnd_paged_prefill_and_mixed(npu):
    # request 0: a 70-token prefill with no cached context; request 1: one decode token after 200
    # cached; request 2: a 40-token chunk after 100 cached (chunked prefill). Cumulative q lengths.
    ctx = [70, 201, 140]
    q_lens = [70, 1, 40]
    kc, vc, bt, ks, vs = paged(ctx)
    q = rnd(sum(q_lens), 4, 64, dtype=torch.float16, seed=7)
    cum = [70, 71, 111]
    nb = kc.shape[0]
    out, lse = npu.npu_fused_infer_attention_score(
        q, kc.view(nb, 128, -1), vc.view(nb, 128, -1), **fia_kwargs(actual_seq_lengths=cum, actual_seq_lengths_kv=ctx,
                                                                   block_table=bt, block_size=128))
    assert out.shape == q.shape and out.dtype == torch.float16 and lse.shape == (0,)  # torch-npu 2.14.0 meta: empty lse without softmax_lse_flag
    starts = [0, 70, 71]
    for r in range(3):
        s, e = starts[r], cum[r]
        ref = dense(q[s:e], ks[r], vs[r], 1 / 8, ctx[r] - q_lens[r])
        torch.testing.assert_close(out[s:e].float(), ref, atol=2e-3, rtol=2e-3)


def test_fia_no_cache_and_bidirectional(npu):
    q, k, v = rnd(10, 4, 64, dtype=torch.float16), rnd(10, 2, 64, dtype=torch.float16, seed=1), rnd(10, 2, 64, dtype=torch.float16, seed=2)
    out, _ = npu.npu_fused_infer_attention_score(q, k, v, **fia_kwargs(actual_seq_lengths=[4, 10],
                                                                       actual_seq_lengths_kv=[4, 10]))
    torch.testing.assert_close(out[4:].float(), dense(q[4:], k[4:], v[4:], 1 / 8, 0), atol=2e-3, rtol=2e-3)
    out0, _ = npu.npu_fused_infer_attention_score(q, k, v, **fia_kwargs(actual_seq_lengths=[10], actual_seq_lengths_kv=[10],
                                                                        sparse_mode=0, atten_mask=None))
    full = dense(q, k, v, 1 / 8, 10)  # offset >= len: nothing masked
    torch.testing.assert_close(out0.float(), full, atol=2e-3, rtol=2e-3)


def test_fia_rejections(npu):
    q, k = rnd(8, 4, 64, dtype=torch.float16), rnd(8, 2, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"queryT\(8\) must be equal to the last element of actualSequenceLengthQ\(5\)"):
        npu.npu_fused_infer_attention_score(q, k, k, **fia_kwargs(actual_seq_lengths=[5], actual_seq_lengths_kv=[5]))
    with pytest.raises(RuntimeError, match="cumulative"):
        npu.npu_fused_infer_attention_score(q, k, k, **fia_kwargs(actual_seq_lengths=[5, 3], actual_seq_lengths_kv=[5, 8]))
    with pytest.raises(RuntimeError, match="192/128/64"):  # TND head dim (CANN-version dependent; conservative)
        q16 = rnd(8, 4, 16, dtype=torch.float16)
        npu.npu_fused_infer_attention_score(q16, q16[:, :2], q16[:, :2], **fia_kwargs(actual_seq_lengths=[8],
                                                                                       actual_seq_lengths_kv=[8]))
    with pytest.raises(RuntimeError, match="2048"):
        npu.npu_fused_infer_attention_score(q, k, k, **fia_kwargs(actual_seq_lengths=[8], actual_seq_lengths_kv=[8],
                                                                  atten_mask=torch.ones(8, 8, dtype=torch.int8)))
    with pytest.raises(RuntimeError, match="N % Nkv"):
        npu.npu_fused_infer_attention_score(q, k, k, **fia_kwargs(actual_seq_lengths=[8], actual_seq_lengths_kv=[8],
                                                                  num_key_value_heads=3))
    with pytest.raises(RuntimeError, match="fp16/bf16"):
        npu.npu_fused_infer_attention_score(q.float(), k.float(), k.float(),
                                            **fia_kwargs(actual_seq_lengths=[8], actual_seq_lengths_kv=[8]))
    with pytest.raises(RuntimeError, match="needs a 3-D query"):
        npu.npu_fused_infer_attention_score(q[None], k, k, **fia_kwargs(actual_seq_lengths=[8], actual_seq_lengths_kv=[8]))
    kc, vc, bt, _, _ = paged([8], bs=16)
    with pytest.raises(RuntimeError, match="multiple of 128"):  # paged, Q_S > 1 (conservative, unconfirmed)
        npu.npu_fused_infer_attention_score(q, kc.view(kc.shape[0], 16, -1), vc.view(vc.shape[0], 16, -1),
                                            **fia_kwargs(actual_seq_lengths=[8], actual_seq_lengths_kv=[8], block_table=bt,
                                                         block_size=16))
    with pytest.raises(RuntimeError, match="sparse_mode 6"):
        npu.npu_fused_infer_attention_score(q, k, k, **fia_kwargs(actual_seq_lengths=[8], actual_seq_lengths_kv=[8],
                                                                  sparse_mode=6))
