"""dce, cse, fold and precision: before/after written as IR text."""

from __future__ import annotations

import math

import torch

from portlayer.capabilities.descriptor import load_descriptor
from portlayer.capabilities.policy import plan_for_graph
from portlayer.flatten.interpret import ExecContext, run_graph
from portlayer.flatten.printer import canonical_text, parse_graph, print_graph
from portlayer.passes.context import PassContext
from portlayer.passes.cse import cse
from portlayer.passes.dce import dce
from portlayer.passes.fold import fold
from portlayer.passes.precision import precision


def _with_weights(g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for name, t in g.params.items():
        g.weights[name] = torch.randn(*t.shape, generator=gen) if t.dtype == "float32" else torch.zeros(t.shape, dtype=torch.int64)
    return g


def test_dce_drops_dead_nodes_and_params_but_keeps_attention():
    before = """
    def forward(x: float32[num_tokens, 4, 2]):
        # params:
        #   w: float32[2]
        #   unused: float32[2]
        dead = mul(x, unused)
        a = attention(x, x, x, num_heads=4, num_kv_heads=4, head_dim=2)
        y = add(x, w)
        return y
    """
    after = """
    def forward(x: float32[num_tokens, 4, 2]):
        # params:
        #   w: float32[2]
        a = attention(x, x, x, num_heads=4, num_kv_heads=4, head_dim=2)
        y = add(x, w)
        return y
    """
    assert print_graph(dce(parse_graph(before))) == canonical_text(after)


def test_cse_merges_equal_nodes_commutative_operands():
    before = """
    def forward(x: float32[num_tokens, 8], y: float32[num_tokens, 8]):
        a = add(x, y)
        b = add(y, x)
        c = silu(a)
        d = silu(b)
        e = mul(c, d)
        return e
    """
    after = """
    def forward(x: float32[num_tokens, 8], y: float32[num_tokens, 8]):
        a = add(x, y)
        c = silu(a)
        e = mul(c, c)
        return e
    """
    assert print_graph(cse(parse_graph(before))) == canonical_text(after)


def test_fold_constants_splats_and_identities():
    before = """
    def forward(ids: int64[num_tokens], x: float32[num_tokens, 4]):
        # params:
        #   w: float32[3, 4]
        #   tt: float32[2, 4]
        wt = transpose(w)
        wt2 = mul(wt, scalar=2.0)
        zeros = full(shape=['num_tokens'], value=0, dtype='int64')
        token_type = embedding(tt, zeros)
        h = add(x, token_type)
        h2 = add(h, scalar=0.0)
        h3 = reshape(h2, shape=['num_tokens', 4])
        one = full(shape=['num_tokens', 4], value=1.0)
        h4 = mul(h3, one)
        y = matmul(h4, wt2)
        return y
    """
    after = """
    def forward(ids: int64[num_tokens], x: float32[num_tokens, 4]):
        # params:
        #   wt2_const: float32[4, 3]
        #   token_type_row: float32[4]
        h = add(x, token_type_row)
        y = matmul(h, wt2_const)
        return y
    """
    g = _with_weights(parse_graph(before))
    out = fold(g)
    assert print_graph(out) == canonical_text(after)
    x = torch.randn(5, 4)
    feeds = {"ids": torch.zeros(5, dtype=torch.int64), "x": x}
    expected = (x + g.weights["tt"][0]) @ (g.weights["w"].T * 2)  # independent torch reference
    assert torch.allclose(run_graph(out, feeds)[0], expected, atol=1e-6)


def test_fold_rope_table_from_static_arange():
    before = """
    def forward(positions: int64[num_tokens], q: float32[num_tokens, 2, 4]):
        # params:
        #   inv_freq: float32[2]
        pos = arange(end=16)
        posf = cast(pos)
        t = reshape(posf, shape=[16, 1])
        f = mul(t, inv_freq)
        c = cos(f)
        s = sin(f)
        cs = concat(c, s, dim=1)
        y = rope(q, positions, cs, rotary_dim=4, head_dim=4)
        return y
    """
    g = parse_graph(before)
    g.weights["inv_freq"] = torch.tensor([1.0, 0.01])
    out = fold(g)
    assert [n.op for n in out.nodes] == ["rope"]
    (table,) = [p for p in out.params]
    pos = torch.arange(16.0)[:, None] * torch.tensor([1.0, 0.01])
    assert torch.allclose(out.weights[table], torch.cat([pos.cos(), pos.sin()], 1))
    assert math.isclose(float(out.weights[table][3, 0]), math.cos(3.0), rel_tol=1e-6)


def test_precision_casts_params_and_retypes():
    before = """
    def forward(ids: int64[num_tokens]):
        # params:
        #   emb: float32[16, 8]
        #   w: float32[8]
        h = embedding(emb, ids)
        y = rms_norm(h, w)
        return y
    """
    after = """
    def forward(ids: int64[num_tokens]):
        # params:
        #   emb: bfloat16[16, 8]
        #   w: bfloat16[8]
        h = embedding(emb, ids)  # bfloat16[num_tokens, 8]
        y = rms_norm(h, w)  # bfloat16[num_tokens, 8]
        return y
    """
    g = _with_weights(parse_graph(before))
    d = load_descriptor("nvidia-h200")
    ctx = PassContext(d, plan_for_graph(g, d))
    assert ctx.plan.compute_dtype == "bfloat16"
    out = precision(g, ctx)
    assert print_graph(out) == canonical_text(after)
    assert out.weights["emb"].dtype == torch.bfloat16
    ids = torch.tensor([1, 2, 3])
    ref = torch.nn.functional.rms_norm(g.weights["emb"][ids].bfloat16().float(), (8,), eps=1e-6) * g.weights["w"].bfloat16().float()
    got = run_graph(out, {"ids": ids}, ExecContext())[0].float()
    assert (got - ref).abs().max() < 0.05
