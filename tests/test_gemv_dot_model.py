"""A tiny HF Qwen3 (q/k norms, GQA) compiled for a descriptor with the few-rows tensor-core tier, under TRITON_INTERPRET=1.

The descriptor is nvidia-h200's with 4 SMs and tuning.gemv_dot_max_tokens = 16 (the shipped H200 has the tier off, as measured: docs/performance.md), so the three
decode batches take the three GEMM paths: 1 row the CUDA-core few-rows kernels, 4 rows their tensor-core tier, 20
rows the norm kernels and vendor GEMMs. The decode step's logits of every sequence are checked against HF's forward
of the same tokens, and the kernels the step launches are counted: the tier's step launches exactly the 1-row
step's kernels (norm + Q|K|V, o-proj, norm + gate|up + SiLU*up, down and the vocabulary projection: one launch per
fused group), each few-rows GEMM as its tensor-core form, where the 20-row step launches no few-rows kernel and
a norm kernel per norm.
"""

from __future__ import annotations

import pytest
import torch
from test_gemv_dot import tier_target
from triton_harness import interpreted_decode_step, rel_err, tiny_causal_lm

import portlayer

pytestmark = pytest.mark.interpreter
VOCAB = 96
ARCHS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(hidden_size=48, intermediate_size=72, num_attention_heads=2, num_key_value_heads=1, head_dim=32)),
}  # one architecture: the tier's kernels are the few-rows kernels' (test_gemv_dot.py checks each form against torch)


@pytest.fixture(scope="module", params=list(ARCHS))
def built(request, tmp_path_factory):
    from portlayer.flatten.tokenizer import write_byte_tokenizer

    root = tmp_path_factory.mktemp(f"gemv-dot-{request.param}")
    cfg_name, model_name, kw = ARCHS[request.param]
    model = tiny_causal_lm(cfg_name, model_name, VOCAB, **kw)
    src = root / "model"
    model.save_pretrained(str(src))
    write_byte_tokenizer(src, vocab_size=VOCAB)
    art = root / "art"
    portlayer.compile(str(src), target=str(tier_target(root, 16)), dtype="float32", output=art, progress=False,
                      sources_only=True, verify=False)
    return model, art


def test_decode_logits_match_hf_at_each_tier_and_the_tier_keeps_the_fusions(built, monkeypatch):
    model, art = built
    g = torch.Generator().manual_seed(1)
    steps = {}
    for batch in (1, 4, 20):
        prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist()
                   for n in torch.randint(2, 5, (batch,), generator=g)]
        nxt = torch.randint(0, VOCAB, (batch,), generator=g).tolist()
        ours, steps[batch] = interpreted_decode_step(art, prompts, nxt, monkeypatch)
        assert ours.shape == (batch, VOCAB), ours.shape
        with torch.inference_mode():
            for i, (p, t) in enumerate(zip(prompts, nxt)):
                want = model(torch.tensor([p + [t]])).logits[0, -1]
                assert rel_err(ours[i], want) <= 1e-4, (batch, i, rel_err(ours[i], want))
    one, tier, vendor = steps[1], steps[4], steps[20]
    few = [n for n in one if n.startswith("gemv_")]
    assert len(few) == 4 * 2 + 1 and not any("dot" in n for n in few), one  # 4 per layer + the vocabulary projection
    assert [n.startswith("gemv_dot_") for n in tier] == [n.startswith("gemv_") for n in one], (one, tier)
    assert [n for n in tier if not n.startswith("gemv_")] == [n for n in one if not n.startswith("gemv_")]
    assert not any(n.startswith("gemv_") for n in vendor), vendor
    norms = sum(n.startswith("reduction_") for n in vendor) - sum(n.startswith("reduction_") for n in tier)
    assert norms >= 2 * 2, vendor  # the 20-row step runs the two norms of each layer as their own kernels
