"""Interpreter tier: every kernel template, rendered for several shapes and dtypes, runs
under TRITON_INTERPRET=1 and matches the op's reference implementation on fresh random
inputs (float32 within 1e-4 relative, float16 within 1e-2; bf16 is checked on the GPU)."""

from __future__ import annotations

import pytest
import torch
from triton_harness import build_program, reference, rel_err, tol, use_interpreter

from portlayer.flatten.ir import GraphBuilder, TensorType

pytestmark = pytest.mark.interpreter
DTYPES = [torch.float32, torch.float16]


@pytest.fixture(autouse=True)
def _interp(monkeypatch):
    use_interpreter(monkeypatch)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check(graph, tmp_path, feeds, kernels: int | None = None, **kw):
    """The pipeline's program matches the reference; ``kernels``: how many groups the fuse pass must form."""
    _, prog = build_program(graph, tmp_path, **kw)
    if kernels is not None:
        groups = [g for g in prog.result.graph.meta["kernels"] if g["family"] != "view"]
        assert len(groups) == kernels, [g["nodes"] for g in groups]
    ours = prog.run(feeds, None, None)
    want = reference(graph, feeds)
    for o, r in zip(ours, want):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert rel_err(o, r) <= tol(r.dtype), (rel_err(o, r), r.dtype)
    return prog


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 96])
def test_pointwise_chain_with_broadcasts(tmp_path, dtype, n):
    b = GraphBuilder()
    x = b.add_input("x", TensorType(_dt(dtype), ("num_tokens", n)))
    y = b.add_input("y", TensorType(_dt(dtype), ("num_tokens", n)))
    bias = b.add_param("bias", torch.randn(n).to(dtype))
    s = b.add1("silu", [x])
    m = b.add1("mul", [s, y])
    a = b.add1("add", [m, bias])
    c = b.add1("mul", [a], {"scalar": 0.5})
    e = b.add1("gelu", [c], {"approximate": "tanh"})
    f = b.add1("sub", [e], {"scalar": 1.0, "reverse": True})
    b.graph.outputs = [f]
    t = 5
    _check(b.graph, tmp_path, {"x": torch.randn(t, n).to(dtype), "y": torch.randn(t, n).to(dtype)})


@pytest.mark.parametrize("op", ["exp", "rsqrt", "tanh", "erf", "sigmoid", "relu", "neg", "abs", "sqrt"])
def test_pointwise_unary_ops(tmp_path, op):
    b = GraphBuilder()
    x = b.add_input("x", TensorType("float32", ("num_tokens", 32)))
    a = b.add1("abs", [x]) if op in ("rsqrt", "sqrt") else x
    y = b.add1(op, [b.add1("add", [a], {"scalar": 0.1}) if a != x else a])
    b.graph.outputs = [y]
    _check(b.graph, tmp_path, {"x": torch.randn(3, 32)})


def test_pointwise_where_compare_cast_and_row_broadcast(tmp_path):
    b = GraphBuilder()
    x = b.add_input("x", TensorType("float32", ("num_tokens", 16)))
    r = b.add_input("r", TensorType("float32", ("num_tokens", 1)))
    c = b.add1("gt", [x, r])
    w = b.add1("where", [c, x], {"y_scalar": 0.0})
    h = b.add1("cast", [w], {"dtype": "float16"})
    p = b.add1("pow", [b.add1("cast", [h], {"dtype": "float32"})], {"scalar": 2})
    b.graph.outputs = [p]
    _check(b.graph, tmp_path, {"x": torch.randn(4, 16), "r": torch.randn(4, 1)})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64,), (3, 16), (100,)])
def test_rms_norm(tmp_path, dtype, shape):
    b = GraphBuilder()
    x = b.add_input("x", TensorType(_dt(dtype), ("num_tokens", *shape)))
    w = b.add_param("w", (1 + 0.1 * torch.randn(shape[-1])).to(dtype))
    b.graph.outputs = [b.add1("rms_norm", [x, w], {"eps": 1e-6})]
    _check(b.graph, tmp_path, {"x": torch.randn(5, *shape).to(dtype)})


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_add_rms_norm_writes_both(tmp_path, dtype):
    b = GraphBuilder()
    x = b.add_input("x", TensorType(_dt(dtype), ("num_tokens", 48)))
    r = b.add_input("r", TensorType(_dt(dtype), ("num_tokens", 48)))
    w = b.add_param("w", torch.randn(48).to(dtype))
    s = b.add1("add", [x, r])
    y = b.add1("rms_norm", [s, w], {"eps": 1e-5, "weight_offset": 1.0})
    b.graph.outputs = [y, s]
    _check(b.graph, tmp_path, {"x": torch.randn(6, 48).to(dtype), "r": torch.randn(6, 48).to(dtype)}, kernels=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [32, 50])
def test_layer_norm_with_epilogue(tmp_path, dtype, n):
    b = GraphBuilder()
    x = b.add_input("x", TensorType(_dt(dtype), ("num_tokens", n)))
    w = b.add_param("w", torch.randn(n).to(dtype))
    bias = b.add_param("b", torch.randn(n).to(dtype))
    y = b.add1("layer_norm", [x, w, bias], {"eps": 1e-5})
    z = b.add1("gelu", [y])
    b.graph.outputs = [z]
    _check(b.graph, tmp_path, {"x": torch.randn(4, n).to(dtype)}, kernels=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax(tmp_path, dtype):
    b = GraphBuilder()
    x = b.add_input("x", TensorType(_dt(dtype), ("num_tokens", 4, 40)))
    b.graph.outputs = [b.add1("softmax", [x], {"dim": -1})]
    _check(b.graph, tmp_path, {"x": (3 * torch.randn(3, 4, 40)).to(dtype)})


def _rope_cache(max_pos: int, rot: int) -> torch.Tensor:
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
    f = torch.arange(max_pos).float()[:, None] * inv[None]
    return torch.cat([f.cos(), f.sin()], -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style,rot,d,hq,hk", [("neox", 16, 16, 4, 2), ("gptj", 16, 16, 3, 1), ("neox", 8, 32, 2, 2),
                                               ("gptj", 12, 16, 4, 4)])
def test_rope_q_and_k_in_one_launch(tmp_path, dtype, style, rot, d, hq, hk):
    b = GraphBuilder()
    q = b.add_input("q", TensorType(_dt(dtype), ("num_tokens", hq, d)))
    k = b.add_input("k", TensorType(_dt(dtype), ("num_tokens", hk, d)))
    pos = b.add_input("positions", TensorType("int64", ("num_tokens",)))
    cache = b.add_param("cache", _rope_cache(64, rot))
    attrs = {"style": style, "rotary_dim": rot, "head_dim": d}
    qo = b.add1("rope", [q, pos, cache], attrs)
    ko = b.add1("rope", [k, pos, cache], attrs)
    b.graph.outputs = [qo, ko]
    t = 5
    feeds = {"q": torch.randn(t, hq, d).to(dtype), "k": torch.randn(t, hk, d).to(dtype),
             "positions": torch.randint(0, 64, (t,))}
    gen = _check(b.graph, tmp_path, feeds, kernels=1)  # q and k rotate in one launch
    assert len(gen.KERNELS) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding(tmp_path, dtype):
    b = GraphBuilder()
    ids = b.add_input("ids", TensorType("int64", ("num_tokens",)))
    w = b.add_param("w", torch.randn(50, 72).to(dtype))
    b.graph.outputs = [b.add1("embedding", [w, ids])]
    _check(b.graph, tmp_path, {"ids": torch.randint(0, 50, (7,))})


def _gemm_graph(dtype, n, k, bias: bool, epilogue: bool):
    b = GraphBuilder()
    x = b.add_input("x", TensorType(_dt(dtype), ("num_tokens", k)))
    r = b.add_input("r", TensorType(_dt(dtype), ("num_tokens", n)))
    w = b.add_param("w", (torch.randn(n, k) / k**0.5).to(dtype))
    ins = [x, w, b.add_param("bias", torch.randn(n).to(dtype))] if bias else [x, w]
    y = b.add1("linear", ins)
    if epilogue:
        y = b.add1("add", [b.add1("silu", [y]), r])
    b.graph.outputs = [y]
    return b.graph


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,bias,epilogue", [(48, 40, False, False), (64, 32, True, True), (20, 72, False, True)])
@pytest.mark.parametrize("path", ["triton", "vendor"])
def test_gemm_with_epilogue(tmp_path, dtype, n, k, bias, epilogue, path):
    if path == "vendor" and dtype == torch.float16:
        pytest.skip("torch.mm in float16 on CPU is the vendor path's concern, not a template's")
    graph = _gemm_graph(dtype, n, k, bias, epilogue)
    launch = {"gemm": {"num_warps": 4, "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "num_stages": 2}}
    t = 19
    feeds = {"x": torch.randn(t, k).to(dtype), "r": torch.randn(t, n).to(dtype)}
    # silu fuses into the GEMM; the add of the activation r is a residual stream and stays apart
    _check(graph, tmp_path, feeds, kernels=2 if epilogue else 1, launch=launch,
           triton_gemm_max_tokens=(1 << 30) if path == "triton" else 0)


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] in -8..7 -> uint8 [N, K/2], low nibble = even column, each nibble q + 8 (written out here,
    not taken from the code under test)."""
    u = (q + 8).to(torch.int32)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,k,group,offsets,bias,epilogue", [
    (8, 64, 64, False, False, False), (8, 96, 32, False, True, False), (4, 64, 32, False, False, True),
    (4, 128, 64, True, True, False), (4, 64, 64, True, False, False), (8, 64, 32, True, False, True)])
def test_weight_only_quantized_gemm(tmp_path, monkeypatch, dtype, bits, k, group, offsets, bias, epilogue):
    """linear_wq in the Triton GEMM: the K loop reads integers and applies scales (and offsets) per
    group; compared with x @ (q * s + o)^T computed here in float64. (The dequantize + vendor GEMM path
    above tuning.wq_vendor_min_tokens: tests/test_quant_fused_decode.py; pinned off here.)"""
    from portlayer.codegen import gemm_rule

    monkeypatch.setattr(gemm_rule, "wq_vendor_min_tokens", lambda descriptor: 0)
    g = torch.Generator().manual_seed(bits * 1000 + k + group)
    n, t = 40, 9
    lo, hi = (-8, 8) if bits == 4 else (-128, 128)
    q = torch.randint(lo, hi, (n, k), generator=g)
    s = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    o = torch.randn(n, k // group, generator=g) * 0.01 if offsets else None
    bvec = torch.randn(n, generator=g) if bias else None
    x = torch.randn(t, k, generator=g).to(dtype)
    w = q.double() * s.double().repeat_interleave(group, 1)
    if o is not None:
        w = w + o.double().repeat_interleave(group, 1)
    want = x.double() @ w.T + (bvec.double() if bias else 0)
    bld = GraphBuilder()
    xi = bld.add_input("x", TensorType(_dt(dtype), ("num_tokens", k)))
    qw = bld.add_param("qw", _pack4(q) if bits == 4 else q.to(torch.int8))
    sc = bld.add_param("scales", s)
    ins = [xi, qw, sc, bld.add_param("bias", bvec.to(dtype)) if bias else None]
    if o is not None:
        ins.append(bld.add_param("offsets", o))
    y = bld.add1("linear_wq", ins, {"bits": bits, "group_size": group})
    if epilogue:
        y = bld.add1("silu", [y])
        want = want * torch.sigmoid(want)
    bld.graph.outputs = [y]
    _, prog = build_program(bld.graph, tmp_path, gemv_dot_max_tokens=0)  # 9 rows: the tiled GEMM, not the tier
    kernels = [kg for kg in prog.result.graph.meta["kernels"] if kg["family"] != "view"]
    assert len(kernels) == 1 and kernels[0]["impl"] == "triton.gemm_wq", kernels
    ours = prog.run({"x": x}, None, None)[0]
    assert ours.dtype == dtype and rel_err(ours, want) <= tol(dtype), rel_err(ours, want)
    assert "torch.mm" not in (tmp_path / "host.py").read_text()  # no integer weight ever reaches torch.mm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,bias,epilogue", [(48, 40, False, False), (70, 96, True, True), (20, 72, False, True)])
def test_few_rows_gemm_and_the_rows_rule(tmp_path, dtype, n, k, bias, epilogue):
    """At <= gemv_max_tokens rows the few-rows kernel runs (fused epilogue included), above it the
    tensor-core GEMM; both against x @ w^T (+ bias, silu) computed here in float64."""
    g = torch.Generator().manual_seed(n + k)
    b = GraphBuilder()
    x = b.add_input("x", TensorType(_dt(dtype), ("num_tokens", k)))
    wt = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    bt = torch.randn(n, generator=g).to(dtype)
    ins = [x, b.add_param("w", wt), b.add_param("bias", bt)] if bias else [x, b.add_param("w", wt)]
    y = b.add1("linear", ins)
    if epilogue:
        y = b.add1("silu", [y])
    b.graph.outputs = [y]
    launch = {"gemm": {"num_warps": 4, "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "num_stages": 2},
              "gemv": {"num_warps": 4, "TILE": 256, "PROGRAMS": 4, "num_stages": 1}}
    _, prog = build_program(b.graph, tmp_path, launch=launch, triton_gemm_max_tokens=1 << 30, gemv_max_tokens=4,
                            gemv_dot_max_tokens=0)
    host = (tmp_path / "host.py").read_text()
    assert "K.gemv_" in host and "K.gemm_" in host, host
    for t in (1, 3, 4, 7):
        xt = torch.randn(t, k, generator=g).to(dtype)
        want = xt.double() @ wt.double().T + (bt.double() if bias else 0)
        if epilogue:
            want = want * torch.sigmoid(want)
        ours = prog.run({"x": xt}, None, None)[0]
        assert ours.shape == (t, n) and rel_err(ours, want) <= tol(dtype), (t, rel_err(ours, want))


@pytest.mark.parametrize("bits,k,group,offsets", [(8, 96, 32, False), (4, 128, 64, True), (8, 80, 16, True), (4, 96, 32, False), (4, 128, 32, True)])
def test_few_rows_weight_only_quantized(tmp_path, bits, k, group, offsets):
    """linear_wq at decode rows: integers (int4 nibbles unpacked in registers) times per-group scales
    (+ offsets), against x @ (q * s + o)^T in float64; above the rows rule the tensor-core kernel."""
    g = torch.Generator().manual_seed(bits + k + group)
    n = 36
    lo, hi = (-8, 8) if bits == 4 else (-128, 128)
    q = torch.randint(lo, hi, (n, k), generator=g)
    s = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    o = torch.randn(n, k // group, generator=g) * 0.01 if offsets else None
    w = q.double() * s.double().repeat_interleave(group, 1)
    if o is not None:
        w = w + o.double().repeat_interleave(group, 1)
    bld = GraphBuilder()
    xi = bld.add_input("x", TensorType("float32", ("num_tokens", k)))
    ins = [xi, bld.add_param("qw", _pack4(q) if bits == 4 else q.to(torch.int8)), bld.add_param("scales", s), None]
    if o is not None:
        ins.append(bld.add_param("offsets", o))
    bld.graph.outputs = [bld.add1("linear_wq", ins, {"bits": bits, "group_size": group})]
    launch = {"gemv": {"num_warps": 4, "TILE": 512, "PROGRAMS": 4, "num_stages": 1}}
    _, prog = build_program(bld.graph, tmp_path, launch=launch, gemv_max_tokens=2, gemv_dot_max_tokens=0)
    assert "K.gemv_w" in (tmp_path / "host.py").read_text()
    for t in (1, 2, 5):
        x = torch.randn(t, k, generator=g)
        ours = prog.run({"x": x}, None, None)[0]
        assert rel_err(ours, x.double() @ w.T) <= tol(torch.float32), (t, rel_err(ours, x.double() @ w.T))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sibling_linears_share_one_few_rows_launch(tmp_path, dtype):
    """Q/K/V-style projections of one input: one launch at decode rows, one GEMM each above; every
    output against x @ w_i^T computed here in float64."""
    g = torch.Generator().manual_seed(5)
    k, ns = 40, (48, 20, 36)
    b = GraphBuilder()
    x = b.add_input("x", TensorType(_dt(dtype), ("num_tokens", k)))
    ws = [(torch.randn(n, k, generator=g) / k**0.5).to(dtype) for n in ns]
    b.graph.outputs = [b.add1("linear", [x, b.add_param(f"w{i}", w)]) for i, w in enumerate(ws)]
    launch = {"gemm": {"num_warps": 4, "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "num_stages": 2},
              "gemv": {"num_warps": 4, "TILE": 256, "PROGRAMS": 4, "num_stages": 1}}
    _, prog = build_program(b.graph, tmp_path, launch=launch, triton_gemm_max_tokens=1 << 30, gemv_max_tokens=4,
                            gemv_dot_max_tokens=0)
    ks = [kg for kg in prog.result.graph.meta["kernels"] if kg["family"] == "gemm"]
    assert len(ks) == 1 and len(ks[0]["nodes"]) == 3, ks
    host = (tmp_path / "host.py").read_text()
    assert host.count("K.gemv_x3_") == 1 and host.count("K.gemm_") == 3, host
    for t in (1, 4, 6):
        xt = torch.randn(t, k, generator=g).to(dtype)
        outs = prog.run({"x": xt}, None, None)
        for out, w in zip(outs, ws):
            want = xt.double() @ w.double().T
            assert out.shape == want.shape and rel_err(out, want) <= tol(dtype), (t, rel_err(out, want))
