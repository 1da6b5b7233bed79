"""quantize: weight-only int8 / int4 group-wise linear_wq, checked against float HF logits."""

from __future__ import annotations

import torch
from conftest import hf_forward
from passes_samples import ctx_for

from portlayer.flatten import capture, interpret
from portlayer.flatten.interpret import run_graph
from portlayer.flatten.printer import canonical_text, parse_graph, print_graph
from portlayer.passes.pipeline import run_pipeline
from portlayer.passes.quantize import quantize

BEFORE = """
def forward(x: float32[num_tokens, 256]):
    # params:
    #   w: float32[64, 256]
    #   b: float32[64]
    #   head: float32[32, 64]
    y = linear(x, w, b)
    logits = linear(y, head, None)
    return logits
"""
AFTER_INT4 = """
def forward(x: float32[num_tokens, 256]):
    # params:
    #   b: float32[64]
    #   head: float32[32, 64]
    #   w_q4: uint8[64, 128]
    #   w_scales: float32[64, 2]
    #   w_offsets: float32[64, 2]
    y = linear_wq(x, w_q4, w_scales, b, w_offsets, bits=4, group_size=128)
    logits = linear(y, head, None)
    return logits
"""


def _graph():
    g = parse_graph(BEFORE)
    gen = torch.Generator().manual_seed(0)
    for name, t in g.params.items():
        g.weights[name] = torch.randn(*t.shape, generator=gen) * 0.05
    return g


def test_int4_ir_text_and_reference_semantics():
    g = _graph()
    out = quantize(g, ctx_for(g, "cpu-x86_64", weight_quantization="int4"))
    assert print_graph(out) == canonical_text(AFTER_INT4)
    # independent check of the packing: rebuild the weight by hand from nibbles and scales
    q, s, o = out.weights["w_q4"], out.weights["w_scales"], out.weights["w_offsets"]
    lo, hi = (q & 0xF).to(torch.int16) - 8, (q >> 4).to(torch.int16) - 8
    ints = torch.stack([lo, hi], -1).reshape(64, 256).float()
    w_hand = (ints.reshape(64, 2, 128) * s[:, :, None] + o[:, :, None]).reshape(64, 256)
    w = g.weights["w"]
    assert ((w_hand - w).norm() / w.norm()).item() < 0.11  # 16 levels per group (asymmetric): ~9% error
    span = w.reshape(64, 2, 128).amax(-1) - w.reshape(64, 2, 128).amin(-1)
    assert (s <= span / 15 + 1e-6).all()  # the range spans at most 16 levels
    x = torch.randn(3, 256)
    got = run_graph(out, {"x": x})[0]
    ref = torch.nn.functional.linear(torch.nn.functional.linear(x, w_hand, g.weights["b"]), g.weights["head"])
    assert torch.allclose(got, ref, atol=1e-5)


def test_int8_groups_of_32_per_channel_on_request_and_plan_off():
    g = _graph()
    out = quantize(g, ctx_for(g, "cpu-x86_64", weight_quantization="int8"))
    (n,) = out.find("linear_wq")
    assert n.attrs == {"bits": 8, "group_size": 32} and out.params[n.inputs[1]].dtype == "int8" and len(n.inputs) == 5
    ctx = ctx_for(g, "cpu-x86_64", weight_quantization="int8")
    ctx.options.update(group_size=256, symmetric=True)
    (n,) = quantize(g, ctx).find("linear_wq")
    assert n.attrs == {"bits": 8, "group_size": 256} and len(n.inputs) == 4
    assert print_graph(quantize(g, ctx_for(g, "cpu-x86_64"))) == print_graph(g)  # the plan says none


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def test_int8_tiny_qwen3_logits_cosine(captured, tiny_dirs):
    from conftest import hf_model

    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1))
    ref = hf_forward(hf_model(tiny_dirs["tiny-qwen3"]), ids)
    res = run_pipeline(captured["tiny-qwen3"], "cpu-x86_64", overrides={"weight_quantization": "int8"})
    assert len(res.graph.find("linear_wq")) == 14 and res.graph.find("linear")[0].name == "lm_head"
    assert _cos(interpret(res.graph, ids), ref) >= 0.999


def test_int4_tiny_qwen3_group_min_128_k(captured, tiny_dirs):
    """Tiny Qwen3's hidden is 64: group size min(128, K) is 64 for the K=64 projections
    (one group per row) and 128 for down_proj (K=128)."""
    from conftest import hf_model

    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1))
    ref = hf_forward(hf_model(tiny_dirs["tiny-qwen3"]), ids)
    # random token ids are far from the calibration text GPTQ fits (it loses 0.006 cosine here and
    # gains on held-out text: tests/test_quality_gate.py), so this layout check uses round-to-nearest
    res = run_pipeline(captured["tiny-qwen3"], "cpu-x86_64", overrides={"weight_quantization": "int4"},
                       options={"quant_method": "rtn"})
    groups = {n.name.split("_", 1)[1]: n.attrs["group_size"] for n in res.graph.find("linear_wq") if n.name.startswith("l0_")}
    assert groups["mlp_down_proj"] == 128 and groups["self_attn_q_proj"] == 64
    assert _cos(interpret(res.graph, ids), ref) >= 0.99


def test_int4_group128_qwen3_hidden256_logits_cosine(tmp_path):
    """A Qwen3 with hidden 256 / intermediate 512, so int4 really uses groups of 128 columns.
    Measured 0.977-0.978: round-to-nearest int4 (even with the clip search) on random
    Gaussian weights does not reach 0.99 at group 128 (docs/passes.md); this guards the level."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=256, max_position_embeddings=128,
                      tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(2))
    ref = hf_forward(model, ids)
    res = run_pipeline(capture(tmp_path), "cpu-x86_64", overrides={"weight_quantization": "int4"},
                       options={"quant_method": "rtn"})  # random ids: see test_int4_tiny_qwen3_group_min_128_k
    wq = res.graph.find("linear_wq")
    assert wq and all(n.attrs["group_size"] == 128 and n.attrs["bits"] == 4 for n in wq)
    assert _cos(interpret(res.graph, ids), ref) >= 0.97
