"""Projections of one input as one vendor GEMM above the few-rows rule (codegen/kernels/gemm_merged.py).

Tiny HF models (Qwen2: Q|K|V with biases; Gemma: a GELU gate; Qwen3: q/k norms) compiled for the H200 descriptor
(gemv_max_tokens 1, so a 3-sequence decode step and the prefill before it run the vendor path), under the Triton
interpreter: the decode step's logits against HF's forward, and the kernels it launched: one column split for each
Q|K|V and one epilogue over the columns of each gate|up GEMM, per layer, and no separate SiLU*mul kernel.
The load-time concatenation is checked on its own: parts become views of the concatenation, a part the weights
lack is refused before anything changes. The merge rule refuses what one GEMM cannot take.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from triton_harness import compiled_fp32, h200_few_sms, interpreted_decode_step, rel_err, tiny_causal_lm

from portlayer.codegen.gemm_rule import merge_refusal
from portlayer.codegen.host_support import concatenate_weights
from portlayer.flatten.ir import Node, TensorType, Value

VOCAB = 96
LAYERS = 2
ARCHS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(hidden_size=48, intermediate_size=72, num_attention_heads=2, num_key_value_heads=1)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(hidden_size=48, intermediate_size=72, num_attention_heads=2, num_key_value_heads=1, head_dim=24)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(hidden_size=48, intermediate_size=72, num_attention_heads=2, num_key_value_heads=1, head_dim=32)),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def built(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"merged-{request.param}")
    cfg_name, model_name, kw = ARCHS[request.param]
    model = tiny_causal_lm(cfg_name, model_name, VOCAB, layers=LAYERS, **kw)
    return model, compiled_fp32(model, root, VOCAB, h200_few_sms(root))


@pytest.mark.interpreter
def test_merged_projections_match_hf_and_launch_one_gemm_each(built, monkeypatch):
    model, art = built
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in (3, 5, 2)]
    nxt = torch.randint(0, VOCAB, (3,), generator=g).tolist()
    ours, launched = interpreted_decode_step(art, prompts, nxt, monkeypatch)
    with torch.inference_mode():
        for i, (p, t) in enumerate(zip(prompts, nxt)):
            want = model(torch.tensor([p + [t]])).logits[0, -1]
            assert rel_err(ours[i], want) <= 1e-4, (i, rel_err(ours[i], want))
    splits = [k for k in launched if k.startswith("pointwise_split3_")]
    joint = [k for k in launched if "_cols2_" in k]
    assert len(splits) == LAYERS and len(joint) == LAYERS, launched
    assert not any(k.startswith("gemv_") for k in launched[:-1]), launched  # 3 rows: the vendor path
    layout = json.loads((art / "program.json").read_text())
    merged = layout["merged_weights"]
    qkv = [k for k in merged if k.endswith("q_proj_weight_cat3")]
    assert len(qkv) == LAYERS and all(merged[k][1].endswith("k_proj_weight") for k in qkv), merged
    if "qwen2" in str(art):
        assert any(k.endswith("q_proj_bias_cat3") for k in merged), merged


def test_concatenate_weights_makes_views_and_refuses_missing_parts():
    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(6.0, 15.0).reshape(3, 3)
    w = SimpleNamespace(a=a, b=b)
    concatenate_weights(w, {"a_cat2": ["a", "b"]})
    assert torch.equal(w.a_cat2, torch.cat([a, b]))
    assert w.a.data_ptr() == w.a_cat2.data_ptr() and w.b.data_ptr() == w.a_cat2[2:].data_ptr()
    assert torch.equal(w.a, a) and torch.equal(w.b, b)
    untouched = SimpleNamespace(a=a)
    with pytest.raises(KeyError, match="lack"):
        concatenate_weights(untouched, {"a_cat2": ["a", "missing"]})
    assert untouched.a is a and not hasattr(untouched, "a_cat2")
    with pytest.raises(ValueError, match="table"):
        concatenate_weights(SimpleNamespace(a=a), {"a_cat2": "a"})
    with pytest.raises(ValueError, match="differ"):
        concatenate_weights(SimpleNamespace(a=a, c=torch.zeros(2, 4)), {"a_cat2": ["a", "c"]})


def _linear(name: str, x: str, w: str, n: int, bias: str | None = None, op: str = "linear") -> Node:
    ins = [x, w] + ([bias] if bias else [])
    return Node(name, op, ins, [Value(f"{name}_out", TensorType("bfloat16", ("num_tokens", n)))], {})


def test_merge_rule_refuses_what_one_gemm_cannot_take():
    types = {"x": TensorType("bfloat16", ("num_tokens", 64)), "wq": TensorType("bfloat16", (64, 64)),
             "wk": TensorType("bfloat16", (32, 64)), "wv": TensorType("bfloat16", (32, 64)),
             "w8": TensorType("float32", (32, 64)),
             "bq": TensorType("bfloat16", (64,)), "bk": TensorType("bfloat16", (32,)), "bv": TensorType("bfloat16", (32,)),
             "bodd": TensorType("bfloat16", (3,))}
    params = set(types) - {"x"}
    q, k, v = _linear("q", "x", "wq", 64), _linear("k", "x", "wk", 32), _linear("v", "x", "wv", 32)
    assert merge_refusal([q, k, v], types, params) == ""
    qb, kb, vb = _linear("q", "x", "wq", 64, "bq"), _linear("k", "x", "wk", 32, "bk"), _linear("v", "x", "wv", 32, "bv")
    assert merge_refusal([qb, kb, vb], types, params) == ""
    assert "bias" in merge_refusal([qb, k, v], types, params)
    assert "only plain linears" in merge_refusal([q, _linear("k", "x", "wk", 32, op="linear_wq")], types, params)
    assert "reads" in merge_refusal([q, _linear("k", "y", "wk", 32)], types, params)
    assert "dtype" in merge_refusal([q, _linear("k", "x", "w8", 32)], types, params)
    narrow = {"x": TensorType("bfloat16", ("num_tokens", 4)), "w3": TensorType("bfloat16", (3, 4)),
              "w8": TensorType("bfloat16", (8, 4))}  # rows of 8 bytes: the second part would start 24 bytes in
    assert "aligned" in merge_refusal([_linear("o", "x", "w3", 3), _linear("p", "x", "w8", 8)], narrow, {"w3", "w8"})
    odd_bias = [_linear("o", "x", "wq", 64, "bodd"), _linear("p", "x", "wk", 32, "bk")]
    types2 = {**types, "wq": TensorType("bfloat16", (3, 64))}
    assert "aligned" in merge_refusal(odd_bias, types2, params)  # bias rows 3 * 2 bytes in
    assert "not a parameter" in merge_refusal([q, _linear("k", "x", "act", 32)], {**types, "act": types["wk"]}, params)
