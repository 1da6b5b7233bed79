"""Mixture-of-experts decoders (Qwen3-MoE; GLM-4-MoE and DeepSeek-V3 with sigmoid, group-limited
routing, score-correction bias, routed scaling and shared experts; DeepSeek-V3's MLA with
``first_k_dense_replace=1``; DeepSeek-V2's complex rotary): interpret == HF forward, and the compiled CPU artifact generates
HF's greedy tokens through the paged KV cache, with chunked prefill and with preemption.

Routers are initialised away from HF's zeros (and biases made non-zero) so that routing is
not a tie and a wrong top-k, bias or group mask shows up in the logits.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T

import portlayer
from portlayer.flatten import capture, interpret
from portlayer.runtime.engine import LLMEngine
from portlayer.runtime.kv_cache import KVCacheSpec
from portlayer.runtime.loaded import open_artifact
from portlayer.runtime.sequence import SamplingParams

COMMON = dict(vocab_size=128, max_position_embeddings=256, hidden_size=64, intermediate_size=96,
              moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_experts_per_tok=2)
MOE = {
    "qwen3-moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(
        num_key_value_heads=2, head_dim=16, num_experts=8, norm_topk_prob=True)),
    "glm4-moe": (T.Glm4MoeConfig, T.Glm4MoeForCausalLM, dict(
        num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
        n_group=2, topk_group=1, partial_rotary_factor=0.5, routed_scaling_factor=1.5)),
    "deepseek-v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, dict(
        num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
        topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        routed_scaling_factor=2.5)),
    "deepseek-v2-complex-rope": (T.DeepseekV2Config, T.DeepseekV2ForCausalLM, dict(  # polar / complex multiply
        num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)),
}
GENERATE = ["qwen3-moe", "glm4-moe", "deepseek-v3"]
MLA = {"deepseek-v3", "deepseek-v2-complex-rope"}  # raised to mla_attention: the latent KV cache
NEW = 24


def build(name: str) -> torch.nn.Module:
    cfg_cls, model_cls, kw = MOE[name]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**COMMON, **kw})).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(torch.randn_like(m.e_score_correction_bias) * 0.1)
            if getattr(m, "gate_up_proj", None) is not None and m.gate_up_proj.dim() == 3:
                torch.nn.init.normal_(m.gate_up_proj, std=0.05)
                torch.nn.init.normal_(m.down_proj, std=0.05)
            if type(m).__name__.lower().endswith("topkrouter"):
                torch.nn.init.normal_(m.weight, std=0.2)
    return model


@pytest.fixture(scope="module")
def moe_models():
    """name -> (HF model in eager mode, captured graph); each captured once."""
    out = {}
    for name in MOE:
        model = build(name)
        g = capture(model)
        model.set_attn_implementation("eager")
        model.set_experts_implementation("eager")
        out[name] = (model, g)
    return out


@pytest.mark.parametrize("name", sorted(MOE))
def test_interpret_matches_hf(moe_models, name):
    model, g = moe_models[name]
    assert g.find("moe_experts"), "experts not captured as one op"
    if name in MLA:  # every layer's attention reads a latent cache of kv_lora_rank + rope per token
        assert not g.find("attention") and len(g.find("mla_attention")) == 2
        assert (g.meta["num_kv_heads"], g.meta["head_dim"], g.meta["v_head_dim"]) == (1, 16 + 8, 0)
    else:
        assert not g.find("mla_attention")
    gen = torch.Generator().manual_seed(0)
    for length in (1, 9, 40):
        ids = torch.randint(3, 128, (length,), generator=gen)
        with torch.no_grad():
            ref = model(ids[None]).logits[0]
        assert (interpret(g, ids) - ref).abs().max().item() <= 1e-4, (name, length)


def _hf_generate(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", GENERATE)
def test_compiled_generation_matches_hf(moe_models, name, tmp_path):
    """DeepSeek-V3 (MoE + MLA's latent cache) runs the whole engine and the tight one; the other two,
    whose attention is the dense models' path, the tight one over two prompts (test time)."""
    model, g = moe_models[name]
    art = tmp_path / "art"
    portlayer.compile(g, target="cpu-x86_64", output=art, progress=False)
    gen = torch.Generator().manual_seed(1)
    lengths, blocks = ((5, 17, 40), 7) if name == "deepseek-v3" else ((17, 40), 5)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]
    ref = [_hf_generate(model, p) for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    assert open_artifact(art).validate().ok  # includes a paged prefill + decode case
    if name == "deepseek-v3":
        whole = LLMEngine.from_artifact(art)
        assert [o.token_ids for o in whole.generate(prompts, greedy)] == ref
    # chunked prefill (8-token chunks) and preemption (too few blocks of 16 for sequences of up to 64) at once
    budget = blocks * KVCacheSpec.from_meta(g.meta, 16, torch.float32).bytes_per_block
    tight = LLMEngine.from_artifact(art, block_size=16, kv_cache_budget_bytes=budget, prefill_chunk_size=8,
                                    max_batched_tokens=16)
    assert [o.token_ids for o in tight.generate(prompts, greedy)] == ref
    assert tight.stats["preemptions"] > 0 and tight.stats["steps"] > NEW + 1  # chunks: more steps than tokens
