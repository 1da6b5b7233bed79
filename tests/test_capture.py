"""Capture faithfulness: interpret(capture(hf_dir)) == the HF model's own forward."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_ARCHS, hf_forward, hf_model

from portlayer.flatten import capture, interpret
from portlayer.flatten.ops import all_ops


@pytest.mark.parametrize("name", TINY_ARCHS)
def test_interpret_matches_hf_at_several_lengths(name, tiny_dirs, captured):
    g = captured[name]
    model = hf_model(tiny_dirs[name])
    gen = torch.Generator().manual_seed(1)
    for length in (1, 7, 64):  # one graph, dynamic token dim: no re-capture
        ids = torch.randint(0, model.config.vocab_size, (length,), generator=gen)
        ref = hf_forward(model, ids)
        out = interpret(g, ids)
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= 1e-4, (name, length)


@pytest.mark.parametrize("name", TINY_ARCHS)
def test_only_registry_ops_and_flat_stream_inputs(name, captured):
    g = captured[name]
    ops = all_ops()
    assert all(n.op in ops for n in g.nodes)
    assert [(v.name, v.type.shape) for v in g.inputs] == [("input_ids", ("num_tokens",)), ("positions", ("num_tokens",))]
    assert g.find("attention"), "attention must be one portable op"


def test_qwen3_is_raised_to_portable_ops(captured):
    g = captured["tiny-qwen3"]
    counts = g.op_counts()
    layers = g.meta["num_layers"]
    assert counts["attention"] == layers
    assert counts["rope"] == 2 * layers  # q and k
    assert counts["rms_norm"] == 4 * layers + 1  # input, post-attn, q_norm, k_norm + final
    for raw in ("pow", "rsqrt", "cos", "sin", "neg", "concat", "mean"):
        assert raw not in counts, f"raw {raw} chain left in the Qwen3 graph"
    attn = g.find("attention")[0]
    assert attn.attrs["num_heads"] == 4 and attn.attrs["num_kv_heads"] == 2 and attn.attrs["causal"] is True
    # every non-attention value is per-token: leading dim is the token symbol
    for n in g.nodes:
        if n.op not in ("full",):
            assert n.outputs[0].type.shape[0] == "num_tokens", n.name


def test_gpt2_gelu_tanh_raised_and_bert_bidirectional(captured):
    g = captured["tiny-gpt2"]
    assert all(n.attrs["approximate"] == "tanh" for n in g.find("gelu"))
    assert "tanh" not in g.op_counts() and "pow" not in g.op_counts()
    b = captured["tiny-bert"]
    assert all(not n.attrs["causal"] for n in b.find("attention"))
    assert b.meta["task"] == "encoder"


def test_packed_sequences_match_separate_runs(captured, tiny_dirs):
    """Two sequences in one stream (attention metadata) equal two separate HF forwards."""
    from portlayer.flatten.op_defs.attention import AttentionMetadata

    g = captured["tiny-llama"]
    model = hf_model(tiny_dirs["tiny-llama"])
    a, b = torch.randint(0, 256, (5,)), torch.randint(0, 256, (9,))
    out = interpret(g, torch.cat([a, b]), attn_metadata=AttentionMetadata.from_lens([5, 9]))
    assert torch.allclose(out[:5], hf_forward(model, a), atol=1e-4)
    assert torch.allclose(out[5:], hf_forward(model, b), atol=1e-4)


def test_capture_from_module_equals_capture_from_dir(tiny_dirs):
    model = hf_model(tiny_dirs["tiny-qwen2"])
    g = capture(model)
    ids = torch.randint(0, 256, (11,))
    assert torch.allclose(interpret(g, ids), hf_forward(hf_model(tiny_dirs["tiny-qwen2"]), ids), atol=1e-4)


def test_partial_rotary_is_one_rope_op(tmp_path):
    """A model rotating only part of each head (partial_rotary_factor) still raises to rope."""
    from transformers import StableLmConfig, StableLmForCausalLM

    torch.manual_seed(0)
    cfg = StableLmConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=128, max_position_embeddings=128,
                         partial_rotary_factor=0.5)
    model = StableLmForCausalLM(cfg).eval()
    g = capture(model)
    ropes = g.find("rope")
    assert ropes and all(n.attrs["rotary_dim"] == 8 and n.attrs["head_dim"] == 16 for n in ropes)
    ids = torch.randint(0, 128, (13,))
    model.set_attn_implementation("eager")
    assert (interpret(g, ids) - hf_forward(model, ids)).abs().max() <= 1e-4
