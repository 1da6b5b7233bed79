"""Architectures no issue names: capture must generalise (rope variants, sliding window,
softcaps, partial rotary, GPT-J interleaving, offset positions, fused QKV)."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from portlayer.flatten import CaptureError, capture, interpret

COMMON = dict(vocab_size=128, max_position_embeddings=128)
ARCHS = {
    "mistral-sliding-window": (T.MistralConfig, T.MistralForCausalLM, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        sliding_window=4)),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16)),
    "gemma2-softcap": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=4)),
    "phi3-fused-qkv": (T.Phi3Config, T.Phi3ForCausalLM, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        pad_token_id=0)),
    "opt-learned-positions": (T.OPTConfig, T.OPTForCausalLM, dict(
        hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64)),
    "gpt-neox-partial-rotary": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25)),
    "phi-partial-rotary": (T.PhiConfig, T.PhiForCausalLM, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, partial_rotary_factor=0.5)),
    "gptj-interleaved-rope": (T.GPTJConfig, T.GPTJForCausalLM, dict(
        n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=128)),
    "roberta-offset-positions": (T.RobertaConfig, T.RobertaModel, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=140)),
    "llama3-rope-scaling": (T.LlamaConfig, T.LlamaForCausalLM, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
}


def _forward(model, ids):
    with torch.no_grad():
        out = model(ids[None])
    return (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state)[0]


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_arch_matches_hf(name):
    cfg_cls, model_cls, kw = ARCHS[name]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**COMMON, **kw})).eval()
    g = capture(model)
    model.set_attn_implementation("eager")
    gen = torch.Generator().manual_seed(0)
    for length in (1, 9, 40):
        ids = torch.randint(3, 128, (length,), generator=gen)
        assert (interpret(g, ids) - _forward(model, ids)).abs().max().item() <= 1e-4, (name, length)
    if "rope" in name or "rotary" in name or name.startswith(("mistral", "gemma", "phi3", "llama")):
        assert g.find("rope"), f"{name}: rope not raised"
        assert "cos" not in g.op_counts() and "sin" not in g.op_counts()
    if name.startswith("gptj"):
        assert all(n.attrs["style"] == "gptj" for n in g.find("rope"))
    if name.startswith("mistral"):
        assert all(n.attrs["sliding_window"] == 4 for n in g.find("attention"))
    if name.startswith("gemma2"):
        assert all(n.attrs["softcap"] for n in g.find("attention"))


def _hand_attention(attn: torch.nn.Module):
    """A causal attention written out by hand with the module's projections: the modeling code of a model that
    never calls transformers' AttentionInterface (older Falcon did; transformers 5.2x's goes through it)."""

    def forward(hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        b, t, _ = hidden_states.shape
        hd = attn.head_dim
        q = attn.q_proj(hidden_states).view(b, t, -1, hd).transpose(1, 2)
        k = attn.k_proj(hidden_states).view(b, t, -1, hd).transpose(1, 2)
        v = attn.v_proj(hidden_states).view(b, t, -1, hd).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) / hd**0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        return attn.o_proj(out), None

    return forward


def test_model_bypassing_attention_interface_is_refused_clearly():
    torch.manual_seed(0)
    model = T.Qwen3ForCausalLM(T.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                             vocab_size=128)).eval()
    for layer in model.model.layers:
        layer.self_attn.forward = _hand_attention(layer.self_attn)
    with pytest.raises(CaptureError, match="AttentionInterface"):
        capture(model)


def test_captured_graph_round_trips_through_json_and_safetensors(captured, tmp_path):
    from portlayer.flatten.printer import print_graph
    from portlayer.flatten.serialize import load_graph, save_graph

    g = captured["tiny-qwen3"]
    save_graph(g, tmp_path / "g")
    g2 = load_graph(tmp_path / "g")
    assert print_graph(g2, show_meta=True) == print_graph(g, show_meta=True)
    ids = torch.randint(0, 256, (13,))
    assert torch.equal(interpret(g2, ids), interpret(g, ids))


ALIBI = {  # models that add their ALiBi bias to the attention mask in their own modeling code
    "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=128, hidden_size=64, n_layer=1, n_head=4)),
    "falcon_alibi": lambda: T.FalconForCausalLM(T.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1,
                                                               num_attention_heads=4, alibi=True)),
}


@pytest.mark.parametrize("name", sorted(ALIBI))
def test_alibi_models_that_use_the_mask_as_a_tensor_are_refused_by_name(name):
    """Their attention uses the mask as a tensor (adds its ALiBi bias), which the capture's mask stand-in is not:
    a CaptureError naming the model and why, not a TypeError from inside transformers."""
    torch.manual_seed(0)
    model = ALIBI[name]().eval()
    with pytest.raises(CaptureError, match=f"{type(model).__name__}'s attention does not go through .*ALiBi"):
        capture(model)


def test_attention_inputs_the_op_does_not_take_refuse_the_capture():
    """GPT-OSS passes its attention sinks (s_aux) to the attention function as a tensor keyword; the attention op
    has no sinks, so leaving them out would change every output: refused by name, never captured silently wrong."""
    torch.manual_seed(0)
    model = T.GptOssForCausalLM(T.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                               sliding_window=8)).eval()
    with pytest.raises(CaptureError, match="GptOssAttention passes s_aux to its attention"):
        capture(model)


def test_modeling_code_that_views_the_attention_output_is_captured_exactly():
    """AFMoE .view()s the attention output as HF's eager/sdpa outputs allow (contiguous): the capture's output is
    contiguous too, and the graph matches HF."""
    torch.manual_seed(0)
    model = T.AfmoeForCausalLM(T.AfmoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                             num_dense_layers=1)).eval()
    g = capture(model)
    ids = torch.randint(0, 128, (9,))
    assert (interpret(g, ids) - _forward(model, ids)).abs().max().item() <= 1e-4


def test_dynamic_ntk_rope_is_refused_by_name():
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        max_position_embeddings=64, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(CaptureError, match="rope_type 'dynamic'.*not supported"):
        capture(T.LlamaForCausalLM(cfg).eval())


def test_a_model_that_branches_on_the_token_count_is_refused_in_a_few_words():
    """MobileBERT's forward takes another path at one token: torch.export's guard is named, not its whole dump."""
    torch.manual_seed(0)
    cfg = T.MobileBertConfig(vocab_size=64, hidden_size=32, embedding_size=16, intra_bottleneck_size=16,
                             intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, true_hidden_size=16)
    with pytest.raises(CaptureError, match="different path for some token counts") as e:
        capture(T.MobileBertModel(cfg).eval())
    assert len(str(e.value)) < 600
