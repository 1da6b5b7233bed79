"""fuse: kernel groups per docs/contracts.md, legality vs priority, limits from the plan."""

from __future__ import annotations

import warnings

from passes_samples import LAYER, ctx_for, keep_meta

from portlayer.flatten.printer import canonical_text, parse_graph, print_graph
from portlayer.passes.fuse import fuse
from portlayer.passes.pipeline import run_pipeline
from portlayer.passes.select import select

H200_AFTER = """
def forward(input_ids: int64[num_tokens], positions: int64[num_tokens]):
    h = embedding(emb, input_ids)  # float16[num_tokens, 64]  meta={'kernel': 'k000_h'}
    x = rms_norm(h, ln)  # float16[num_tokens, 64]  meta={'kernel': 'k001_q'}
    q = linear(x, wq, None)  # float16[num_tokens, 64]  meta={'kernel': 'k001_q'}
    k = linear(x, wk, None)  # float16[num_tokens, 32]  meta={'kernel': 'k001_q'}
    v = linear(x, wv, None)  # float16[num_tokens, 32]  meta={'kernel': 'k001_q'}
    qh = reshape(q, shape=['num_tokens', 2, 32])  # float16[num_tokens, 2, 32]  meta={'kernel': 'k001_q'}
    kh = reshape(k, shape=['num_tokens', 1, 32])  # float16[num_tokens, 1, 32]  meta={'kernel': 'k001_q'}
    vh = reshape(v, shape=['num_tokens', 1, 32])  # float16[num_tokens, 1, 32]  meta={'kernel': 'k001_q'}
    qr = rope(qh, positions, cache, rotary_dim=32, head_dim=32)  # float16[num_tokens, 2, 32]  meta={'kernel': 'k002_qr'}
    kr = rope(kh, positions, cache, rotary_dim=32, head_dim=32)  # float16[num_tokens, 1, 32]  meta={'kernel': 'k002_qr'}
    a = attention(qr, kr, vh, num_heads=2, head_dim=32)  # float16[num_tokens, 2, 32]  meta={'kernel': 'k003_a'}
    a2 = reshape(a, shape=['num_tokens', 64])  # float16[num_tokens, 64]  meta={'kernel': 'k003_a'}
    o = linear(a2, wo, None)  # float16[num_tokens, 64]  meta={'kernel': 'k004_o'}
    r = add(h, o)  # float16[num_tokens, 64]  meta={'kernel': 'k005_gate'}
    y = rms_norm(r, ln2)  # float16[num_tokens, 64]  meta={'kernel': 'k005_gate'}
    gate = linear(y, wg, None)  # float16[num_tokens, 128]  meta={'kernel': 'k005_gate'}
    act = silu(gate)  # float16[num_tokens, 128]  meta={'kernel': 'k005_gate'}
    up = linear(y, wu, None)  # float16[num_tokens, 128]  meta={'kernel': 'k005_gate'}
    m = mul(act, up)  # float16[num_tokens, 128]  meta={'kernel': 'k005_gate'}
    return m
"""


def _params() -> str:
    return LAYER.split("h = embedding")[0].split("):", 1)[1]


def _canon(after: str) -> str:
    head, body = after.split("):", 1)
    return canonical_text(head + "):" + _params() + body.split("\n", 1)[1], show_meta=True)


def _fused(text: str, target: str, **options):
    g = parse_graph(text)
    ctx = ctx_for(g, target, **options)
    return fuse(select(g, ctx), ctx)


def test_fuse_h200_ir_text_and_kernel_records():
    out = _fused(LAYER, "nvidia-h200")
    assert print_graph(keep_meta(out, ("kernel",)), show_meta=True) == _canon(H200_AFTER)
    ks = {k["name"]: k for k in out.meta["kernels"]}
    # the record names the anchor's registered implementation: its lowering realises the whole group.
    # nvidia-h200 runs the few-rows GEMM at decode (tuning.gemv_max_tokens), so each norm became the
    # prologue of the GEMMs it feeds; above the rows rule the lowering runs it as its own kernel into
    # the scratch the record names
    assert ks["k005_gate"] == {"name": "k005_gate", "family": "gemm", "impl": "triton.gemm", "anchor": "gate",
                               "nodes": ["r", "y", "gate", "act", "up", "m"], "inputs": ["h", "o", "ln2", "wg", "wu"],
                               "outputs": ["m"], "prologue": ["r", "y"], "epilogue": ["act", "m"],
                               "scratch": ["y", "gate", "up"]}
    assert ks["k002_qr"]["family"] == "rope" and ks["k002_qr"]["nodes"] == ["qr", "kr"]
    # Q, K and V read x once: sibling linears side by side, each output leaving the kernel
    assert ks["k001_q"]["nodes"][:4] == ["x", "q", "k", "v"] and ks["k001_q"]["outputs"] == ["qh", "kh", "vh"]
    assert ks["k001_q"]["prologue"] == ["x"] and ks["k001_q"]["epilogue"] == [] and ks["k001_q"]["scratch"] == ["x"]
    # the rope kernel writes the attention's K/V into the paged cache
    assert ks["k002_qr"]["kv_write"] == {"attention": "a", "v": "vh", "layer": 0}
    assert ks["k003_a"]["kv_written_by"] == "k002_qr"
    # legality, not priority, refused the o_proj GEMM into the next one (and x leaving the QKV kernel)
    assert "o+r" in out.meta["fusion"]["refused"]
    assert "never stores the normalised rows" in out.meta["fusion"]["refused"]["x+q"]


def test_fuse_without_few_rows_kernel_keeps_the_norms():
    """amd-mi300x has no tuning.gemv_max_tokens: a norm prologue would save nothing there."""
    out = _fused(LAYER, "amd-mi300x")
    ks = {k["anchor"]: k for k in out.meta["kernels"]}
    assert ks["y"]["impl"] == "triton.rms_norm" and ks["y"]["nodes"] == ["r", "y"]
    assert ks["x"]["nodes"] == ["x"] and "prologue" not in ks["q"]
    assert "gemv_max_tokens = 0" in out.meta["fusion"]["refused"]["x+q"]


def test_fuse_respects_max_fused_inputs():
    out = _fused(LAYER, "nvidia-h200", max_fused_inputs=2)
    ks = {k["name"]: k for k in out.meta["kernels"]}
    assert all(len(k["inputs"]) <= 2 for k in ks.values() if len(k["nodes"]) > 1 and k["family"] != "attention")
    assert any("max_fused_inputs=2" in why for why in out.meta["fusion"]["refused"].values())


def test_fuse_ascend_vendor_groups_are_sealed():
    out = _fused(LAYER, "ascend-910b")
    ks = {k["impl"]: k for k in out.meta["kernels"]}
    assert ks["cann.npu_add_rms_norm"]["family"] == "vendor" and ks["cann.npu_add_rms_norm"]["nodes"] == ["r", "y"]
    assert ks["cann.npu_mrope"]["nodes"] == ["qr", "kr"]
    # aclnn calls are single kernels: silu and mul stay apart
    assert [k["nodes"] for k in out.meta["kernels"] if k["impl"] == "cann.elementwise"] == [["act"], ["m"]]


def test_fuse_cpu_torch_ops_stay_single():
    out = _fused(LAYER, "cpu-x86_64")
    for k in out.meta["kernels"]:
        assert len([n for n in k["nodes"] if n not in ("qh", "kh", "vh", "a2")]) == 1


def _check_contract(graph) -> None:
    ks = graph.meta["kernels"]
    seen = [n for k in ks for n in k["nodes"]]
    assert seen == [n.name for n in graph.nodes]  # every node in exactly one kernel, kernels contiguous, in order
    for k in ks:
        assert set(k) >= {"name", "family", "impl", "nodes", "inputs", "outputs"}
        assert k["family"] in ("pointwise", "reduction", "rope", "gemm", "attention", "embedding", "view", "pooling",
                               "vendor")
        assert all(graph.node(n).meta["kernel"] == k["name"] for n in k["nodes"])


def test_tiny_qwen3_h200_fusion_ratio(captured):
    res = run_pipeline(captured["tiny-qwen3"], "nvidia-h200")
    before = dict(res.history)["select"]["nodes_after"]
    kernels = len(res.graph.meta["kernels"])
    assert kernels <= 0.55 * before, (kernels, before)
    _check_contract(res.graph)
    groups: dict[str, list[list[str]]] = {}
    for k in res.graph.meta["kernels"]:
        ops = sorted(res.graph.node(n).op for n in k["nodes"] if res.graph.node(n).op != "reshape")
        if len(ops) > 1 and ops not in groups.setdefault(k["impl"], []):
            groups[k["impl"]].append(ops)
    assert groups["triton.rope"] == [["rms_norm", "rms_norm", "rope", "rope"]]  # q/k norm + rope: one kernel
    # norm + Q|K|V side by side, norm + gate|up with the silu * up epilogue (decode: one launch each), and
    # the final residual add + norm in the (small: under gemv_max_weight_mib) vocabulary projection
    assert sorted(groups["triton.gemm"]) == [["add", "linear", "linear", "linear", "rms_norm"],
                                             ["add", "linear", "linear", "mul", "rms_norm", "silu"],
                                             ["add", "linear", "rms_norm"],
                                             ["linear", "linear", "linear", "rms_norm"]]


def test_gpt2_bias_activation_epilogue_and_bert(captured):
    res = run_pipeline(captured["tiny-gpt2"], "nvidia-h200")
    _check_contract(res.graph)
    gelu_k = next(k for k in res.graph.meta["kernels"] if any("gelu" in n for n in k["nodes"]))
    assert gelu_k["family"] == "gemm" and gelu_k["epilogue"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for target in ("amd-mi300x", "ascend-910b", "cpu-x86_64"):
            _check_contract(run_pipeline(captured["tiny-bert"], target).graph)
