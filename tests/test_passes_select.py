"""select: the implementation per node follows the descriptor; refusals carry reasons."""

from __future__ import annotations

import warnings

import pytest
from passes_samples import LAYER, ctx_for, keep_meta

from portlayer.flatten.printer import canonical_text, parse_graph, print_graph
from portlayer.passes.pipeline import run_pipeline
from portlayer.passes.select import FallbackWarning, select

KEYS = ("impl", "fused_into")

ASCEND_AFTER = """
def forward(input_ids: int64[num_tokens], positions: int64[num_tokens]):
    h = embedding(emb, input_ids)  # float16[num_tokens, 64]  meta={'impl': 'torch.embedding'}
    x = rms_norm(h, ln)  # float16[num_tokens, 64]  meta={'impl': 'cann.npu_rms_norm'}
    q = linear(x, wq, None)  # float16[num_tokens, 64]  meta={'impl': 'cann.linear'}
    k = linear(x, wk, None)  # float16[num_tokens, 32]  meta={'impl': 'cann.linear'}
    v = linear(x, wv, None)  # float16[num_tokens, 32]  meta={'impl': 'cann.linear'}
    qh = reshape(q, shape=['num_tokens', 2, 32])  # float16[num_tokens, 2, 32]  meta={'impl': 'torch.view'}
    kh = reshape(k, shape=['num_tokens', 1, 32])  # float16[num_tokens, 1, 32]  meta={'impl': 'torch.view'}
    vh = reshape(v, shape=['num_tokens', 1, 32])  # float16[num_tokens, 1, 32]  meta={'impl': 'torch.view'}
    qr = rope(qh, positions, cache, rotary_dim=32, head_dim=32)  # float16[num_tokens, 2, 32]  meta={'impl': 'cann.npu_mrope', 'fused_into': 'kr'}
    kr = rope(kh, positions, cache, rotary_dim=32, head_dim=32)  # float16[num_tokens, 1, 32]  meta={'impl': 'cann.npu_mrope'}
    a = attention(qr, kr, vh, num_heads=2, num_kv_heads=1, head_dim=32)  # float16[num_tokens, 2, 32]  meta={'impl': 'cann._npu_paged_attention'}
    a2 = reshape(a, shape=['num_tokens', 64])  # float16[num_tokens, 64]  meta={'impl': 'torch.view'}
    o = linear(a2, wo, None)  # float16[num_tokens, 64]  meta={'impl': 'cann.linear'}
    r = add(h, o)  # float16[num_tokens, 64]  meta={'impl': 'cann.npu_add_rms_norm', 'fused_into': 'y'}
    y = rms_norm(r, ln2)  # float16[num_tokens, 64]  meta={'impl': 'cann.npu_add_rms_norm'}
    gate = linear(y, wg, None)  # float16[num_tokens, 128]  meta={'impl': 'cann.linear'}
    act = silu(gate)  # float16[num_tokens, 128]  meta={'impl': 'cann.elementwise'}
    up = linear(y, wu, None)  # float16[num_tokens, 128]  meta={'impl': 'cann.linear'}
    m = mul(act, up)  # float16[num_tokens, 128]  meta={'impl': 'cann.elementwise'}
    return m
"""


def _after(text: str, before: str = LAYER) -> str:
    params = before.split("h = embedding")[0].split("):", 1)[1]
    head, body = text.split("):", 1)
    return canonical_text(head + "):" + params + body.split("\n", 1)[1], show_meta=True)


def test_select_ascend_fused_cann_ops_ir_text():
    g = parse_graph(LAYER)
    out = select(g, ctx_for(g, "ascend-910b"))
    assert print_graph(keep_meta(out, KEYS), show_meta=True) == _after(ASCEND_AFTER)
    by = {n.name: n for n in out.nodes}
    assert by["kr"].meta["absorbs"] == ["qr"]
    swiglu = by["m"].meta["refused"][0]
    assert swiglu["impl"] == "cann.npu_swiglu" and "two halves of one tensor" in swiglu["reason"]
    fia = by["a"].meta["refused"][0]
    assert fia["impl"] == "cann.npu_fused_infer_attention_score" and "head_dim 32" in fia["reason"]


@pytest.mark.parametrize("target,family", [("nvidia-h200", "triton"), ("amd-mi300x", "triton"),
                                           ("cpu-x86_64", "torch")])
def test_select_same_nodes_other_devices(target, family):
    g = parse_graph(LAYER)
    out = select(g, ctx_for(g, target))
    by = {n.name: n for n in out.nodes}
    for name in ("r", "y", "qr", "kr", "x", "m"):
        assert by[name].meta["impl_family"] == family, (name, by[name].meta)
        assert "fused_into" not in by[name].meta
        refused = {r["impl"]: r["reason"] for r in by[name].meta["refused"]}
        if name == "y":
            assert "cann" in refused["cann.npu_add_rms_norm"]
    assert by["q"].meta["impl"] == ("triton.gemm" if family == "triton" else "torch.linear")


def test_select_without_matrix_units_uses_vendor_blas():
    g = parse_graph(LAYER)
    out = select(g, ctx_for(g, "intel-uhd-770"))
    q = out.node("q")
    assert q.meta["impl"] == "vendor_gemm"
    assert any(r["impl"] == "triton.gemm" and "matrix units" in r["reason"] for r in q.meta["refused"])


def test_select_falls_back_with_warning():
    g = parse_graph(LAYER.replace("float16", "float32"))
    with pytest.warns(FallbackWarning, match="no implementation of 'attention' accepts node a"):
        out = select(g, ctx_for(g, "ascend-910b"))
    assert out.node("a").meta["impl"] == "reference"
    # in float32 npu_mrope takes head 32 (multiple of 16)
    assert out.node("kr").meta["impl"] == "cann.npu_mrope"


def test_tiny_qwen3_ascend_h200_cpu(captured):
    g = captured["tiny-qwen3"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        asc = run_pipeline(g, "ascend-910b")
    h200 = run_pipeline(g, "nvidia-h200")
    cpu = run_pipeline(g, "cpu-x86_64")
    fused_norm, fused_rope = {"cann.npu_add_rms_norm"}, {"cann.npu_mrope", "cann._npu_rotary_embedding"}
    a = {n.name: n.meta for n in asc.graph.nodes}
    norm_nodes = [n for n, m in a.items() if m["impl"] in fused_norm]
    rope_nodes = [n for n, m in a.items() if m["impl"] in fused_rope]
    assert len(norm_nodes) == 2 * 4 and len(rope_nodes) == 4  # 4 add+norm pairs (2 per layer, the last is the final norm), q/k rope x2
    kinds = {k["impl"]: k["family"] for k in asc.graph.meta["kernels"]}
    assert kinds["cann.npu_add_rms_norm"] == "vendor" and kinds["cann._npu_rotary_embedding"] == "vendor"
    align = asc.descriptor.memory.alignment_bytes
    assert align == 512 and asc.graph.meta["memory_plan"]["alignment"] == 512
    assert all(b["offset"] % align == 0 for b in asc.graph.meta["memory_plan"]["buffers"].values())
    h = {n.name: n.meta for n in h200.graph.nodes}
    c = {n.name: n.meta for n in cpu.graph.nodes}
    for name in norm_nodes + rope_nodes:
        assert h[name]["impl_family"] == "triton" and h[name]["impl"].startswith("triton.")
        assert c[name]["impl_family"] == "torch"
    assert all(b["offset"] % 256 == 0 for b in h200.graph.meta["memory_plan"]["buffers"].values())
