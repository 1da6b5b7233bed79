"""Before/after tests for each pattern raiser, written as IR text, plus a numeric check."""

from __future__ import annotations

import math

import torch

from portlayer.flatten.interpret import ExecContext, run_graph
from portlayer.flatten.patterns import (
    fold_view_chains,
    raise_gelu,
    raise_layer_norm,
    raise_rms_norm,
    raise_rope,
)
from portlayer.flatten.printer import canonical_text, parse_graph, print_graph
from portlayer.flatten.squeeze_batch import squeeze_unit_batch
from portlayer.flatten.verify import verify_graph


def _with_weights(g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for name, t in g.params.items():
        g.weights[name] = torch.randn(*[int(d) for d in t.shape], generator=gen)
    return g


def _run(g, feeds, n):
    return run_graph(g, feeds, ExecContext(bindings={"num_tokens": n}))[0]


def _same_numbers(before, after, feeds, n):
    after.weights = {**before.weights, **after.weights}
    assert torch.allclose(_run(before, feeds, n), _run(after, feeds, n), atol=1e-5)


RMS_BEFORE = """
def forward(x: float32[num_tokens, 8]):
    # params:
    #   w: float32[8]
    sq = pow(x, scalar=2)
    var = mean(sq, dims=[-1], keepdim=True)
    var_eps = add(var, scalar=1e-06)
    inv = rsqrt(var_eps)
    normed = mul(x, inv)
    out = mul(w, normed)
    return out
"""
RMS_AFTER = """
def forward(x: float32[num_tokens, 8]):
    # params:
    #   w: float32[8]
    out_rms_norm = rms_norm(x, w)
    return out_rms_norm
"""


def test_rms_norm_raised():
    before = _with_weights(parse_graph(RMS_BEFORE))
    after = raise_rms_norm(before)
    verify_graph(after)
    assert print_graph(after) == canonical_text(RMS_AFTER)
    _same_numbers(before, after, {"x": torch.randn(5, 8)}, 5)


GELU_BEFORE = f"""
def forward(x: float32[num_tokens, 16]):
    half = mul(x, scalar=0.5)
    cube = pow(x, scalar=3.0)
    c = mul(cube, scalar=0.044715)
    inner = add(x, c)
    scaled = mul(inner, scalar={math.sqrt(2.0 / math.pi)!r})
    t = tanh(scaled)
    one_t = add(t, scalar=1.0)
    out = mul(half, one_t)
    return out
"""
GELU_AFTER = """
def forward(x: float32[num_tokens, 16]):
    out_gelu = gelu(x, approximate='tanh')
    return out_gelu
"""


def test_gelu_tanh_raised():
    before = parse_graph(GELU_BEFORE)
    after = raise_gelu(before)
    assert print_graph(after) == canonical_text(GELU_AFTER)
    _same_numbers(before, after, {"x": torch.randn(3, 16)}, 3)


LN_BEFORE = """
def forward(x: float32[num_tokens, 8]):
    # params:
    #   w: float32[8]
    #   b: float32[8]
    mu = mean(x, dims=[-1], keepdim=True)
    xc = sub(x, mu)
    sq = pow(xc, scalar=2.0)
    var = mean(sq, dims=[-1], keepdim=True)
    var_eps = add(var, scalar=1e-05)
    inv = rsqrt(var_eps)
    normed = mul(xc, inv)
    scaled = mul(normed, w)
    out = add(scaled, b)
    return out
"""
LN_AFTER = """
def forward(x: float32[num_tokens, 8]):
    # params:
    #   w: float32[8]
    #   b: float32[8]
    out_layer_norm = layer_norm(x, w, b)
    return out_layer_norm
"""


def test_layer_norm_raised():
    before = _with_weights(parse_graph(LN_BEFORE))
    after = raise_layer_norm(before)
    assert print_graph(after) == canonical_text(LN_AFTER)
    _same_numbers(before, after, {"x": torch.randn(4, 8)}, 4)


ROPE_BEFORE = """
def forward(x: float32[num_tokens, 2, 8], positions: int64[num_tokens]):
    # params:
    #   inv_freq: float32[4]
    pf = cast(positions)
    pcol = reshape(pf, shape=['num_tokens', 1])
    freqs = mul(pcol, inv_freq)
    emb = concat(freqs, freqs, dim=1)
    c = cos(emb)
    s = sin(emb)
    c3 = reshape(c, shape=['num_tokens', 1, 8])
    s3 = reshape(s, shape=['num_tokens', 1, 8])
    xc = mul(x, c3)
    hi = slice(x, dim=2, start=4)
    lo = slice(x, dim=2, end=4)
    nhi = neg(hi)
    rot = concat(nhi, lo, dim=2)
    xs = mul(rot, s3)
    out = add(xc, xs)
    return out
"""
ROPE_AFTER = """
def forward(x: float32[num_tokens, 2, 8], positions: int64[num_tokens]):
    # params:
    #   rope_cos_sin_cache: float32[16, 8]
    out_rope = rope(x, positions, rope_cos_sin_cache, rotary_dim=8, head_dim=8)
    return out_rope
"""


def test_rope_raised_with_position_table():
    before = parse_graph(ROPE_BEFORE)
    before.weights["inv_freq"] = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    before.meta["max_positions"] = 16
    after = raise_rope(before)
    assert print_graph(after) == canonical_text(ROPE_AFTER)
    pos = torch.tensor([3, 0, 15, 7, 7])
    _same_numbers(before, after, {"x": torch.randn(5, 2, 8), "positions": pos}, 5)


def test_rope_not_raised_when_cos_depends_on_more_than_positions():
    text = ROPE_BEFORE.replace("pf = cast(positions)", "pf0 = cast(positions)\n    pf = mul(pf0, x_scale)").replace(
        "def forward(x: float32[num_tokens, 2, 8], positions: int64[num_tokens]):",
        "def forward(x: float32[num_tokens, 2, 8], positions: int64[num_tokens], x_scale: float32[num_tokens]):")
    before = parse_graph(text)
    before.weights["inv_freq"] = torch.ones(4)
    after = raise_rope(before)
    assert "rope" not in after.op_counts()


VIEWS_BEFORE = """
def forward(x: float32[num_tokens, 4, 16]):
    a = transpose(x, dim0=0, dim1=1)
    b = transpose(a, dim0=0, dim1=1)
    c = reshape(b, shape=[1, 'num_tokens', 4, 16])
    d = permute(c, dims=[0, 2, 1, 3])
    e = reshape(d, shape=[4, 'num_tokens', 16])
    f = transpose(e, dim0=0, dim1=1)
    g = reshape(f, shape=['num_tokens', 64])
    return g
"""
VIEWS_AFTER = """
def forward(x: float32[num_tokens, 4, 16]):
    g = reshape(x, shape=['num_tokens', 64])
    return g
"""


def test_view_chains_fold_to_one_reshape():
    before = parse_graph(VIEWS_BEFORE)
    after = fold_view_chains(before)
    assert print_graph(after) == canonical_text(VIEWS_AFTER)
    _same_numbers(before, after, {"x": torch.randn(3, 4, 16)}, 3)


def test_view_chain_that_really_permutes_is_kept():
    text = """
def forward(x: float32[num_tokens, 4, 16]):
    a = transpose(x, dim0=0, dim1=1)
    b = reshape(a, shape=[4, -1])
    return b
"""
    before = parse_graph(text)
    assert print_graph(fold_view_chains(before)) == print_graph(before)


SQUEEZE_BEFORE = """
def forward(input_ids: int64[num_tokens]):
    # params:
    #   emb_w: float32[32, 8]
    #   w: float32[8]
    ids = reshape(input_ids, shape=[1, 'num_tokens'])
    h = embedding(emb_w, ids)
    n = rms_norm(h, w)
    s = softmax(n, dim=2)
    r = reshape(s, shape=['num_tokens', 8])
    return r
"""
SQUEEZE_AFTER = """
def forward(input_ids: int64[num_tokens]):
    # params:
    #   emb_w: float32[32, 8]
    #   w: float32[8]
    h = embedding(emb_w, input_ids)
    n = rms_norm(h, w)
    s = softmax(n, dim=1)
    return s
"""


def test_unit_batch_squeezed():
    before = _with_weights(parse_graph(SQUEEZE_BEFORE))
    after = fold_view_chains(squeeze_unit_batch(before))
    assert print_graph(after) == canonical_text(SQUEEZE_AFTER)
    _same_numbers(before, after, {"input_ids": torch.tensor([1, 5, 31])}, 3)


ATTN_BEFORE = """
def forward(q: float32[1, 4, num_tokens, 8], k: float32[1, 2, num_tokens, 8], v: float32[1, 2, num_tokens, 8]):
    k5 = reshape(k, shape=[1, 2, 1, 'num_tokens', 8])
    kx = expand(k5, shape=[1, 2, 2, 'num_tokens', 8])
    kr = reshape(kx, shape=[1, 4, 'num_tokens', 8])
    v5 = reshape(v, shape=[1, 2, 1, 'num_tokens', 8])
    vx = expand(v5, shape=[1, 2, 2, 'num_tokens', 8])
    vr = reshape(vx, shape=[1, 4, 'num_tokens', 8])
    kt = transpose(kr, dim0=2, dim1=3)
    scores = matmul(q, kt)
    scaled = mul(scores, scalar=0.35355339059327373)
    probs = softmax(scaled, dim=-1)
    out = matmul(probs, vr)
    return out
"""


def test_attention_chain_with_repeat_kv_raised_to_gqa_attention():
    from portlayer.flatten.attention_pattern import raise_attention_chains

    before = parse_graph(ATTN_BEFORE)
    after = fold_view_chains(raise_attention_chains(before))
    (attn,) = after.find("attention")
    assert attn.attrs["num_heads"] == 4 and attn.attrs["num_kv_heads"] == 2 and attn.attrs["causal"] is False
    assert "softmax" not in after.op_counts() and "expand" not in after.op_counts()
    feeds = {"q": torch.randn(1, 4, 6, 8), "k": torch.randn(1, 2, 6, 8), "v": torch.randn(1, 2, 6, 8)}
    _same_numbers(before, after, feeds, 6)
    ref = torch.nn.functional.scaled_dot_product_attention(
        feeds["q"], feeds["k"].repeat_interleave(2, 1), feeds["v"].repeat_interleave(2, 1))
    assert torch.allclose(_run(after, feeds, 6), ref, atol=1e-5)


def test_eager_bert_with_mask_building_ops_still_matches_hf(tiny_dirs):
    """BERT with HF's *eager* attention (no portlayer hook): HF builds and adds a mask, so the
    chain is masked and is (correctly) left as explicit ops; conversion must still be exact."""
    from conftest import hf_forward, hf_model

    from portlayer.flatten.capture import export_token_stream
    from portlayer.flatten.from_export import convert_exported_program
    from portlayer.flatten.interpret import interpret
    from portlayer.flatten.patterns import raise_patterns

    model = hf_model(tiny_dirs["tiny-bert"])  # eager attention
    g = convert_exported_program(export_token_stream(model, max_tokens=512))
    g.meta["max_positions"] = 512
    g = raise_patterns(g)
    assert not g.find("attention") and "softmax" in g.op_counts()
    ids = torch.randint(0, 256, (11,))
    assert (interpret(g, ids) - hf_forward(model, ids)).abs().max() <= 1e-4
