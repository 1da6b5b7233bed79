"""The tensor_parallel decision of the policy (capabilities/tp_degree.py): no processes, no models.

The expected degrees are worked out by hand from the config and the descriptor's memory below."""

from __future__ import annotations

import pytest
import torch

from portlayer.capabilities.plan import PlanError
from portlayer.capabilities.policy import negotiate
from portlayer.capabilities.requirements import ModelRequirements

# Llama-3-8B's shape: 8.03e9 parameters -> 16.06 GB in bf16; KV 32 layers x 2 x 8 heads x 128 x 2 B = 128 KiB/token
LLAMA8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
           "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}


def req() -> ModelRequirements:
    return ModelRequirements.from_hf_config(LLAMA8B, name="llama-8b-shape")


def test_auto_picks_the_smallest_degree_that_fits():
    # RTX 4060 laptop: 8 GB x 0.9 = 7.2 GB usable. N=1: 16.06 GB + 1 GiB KV; N=2: 8.03 GB + 0.5 GiB: too big;
    # N=4: 4.02 GB + 0.25 GiB fits.
    plan = negotiate(req(), "nvidia-rtx4060-laptop", {"tensor_parallel": "auto"})
    d = plan.decision("tensor_parallel")
    assert d.value == 4
    assert "N=1" in d.reason and "N=2" in d.reason and "did not" in d.reason
    # the H200's 141 GB hold it on one device
    assert negotiate(req(), "nvidia-h200", {"tensor_parallel": "auto"}).value("tensor_parallel") == 1


def test_budgets_are_per_rank():
    one = negotiate(req(), "nvidia-h200", {})
    two = negotiate(req(), "nvidia-h200", {"tensor_parallel": 2})
    assert one.value("tensor_parallel") == 1 and two.value("tensor_parallel") == 2
    # half the weights on each rank leave ~8 GB more for KV; a token's KV is half as large (4 of 8 KV heads)
    gained = two.kv_cache_budget_bytes - one.kv_cache_budget_bytes
    assert 7.9e9 < gained < 8.1e9
    item = getattr(torch, two.kv_cache_dtype).itemsize  # bytes an element of the Plan's cache dtype
    assert two.value("max_kv_tokens") == pytest.approx(2 * two.kv_cache_budget_bytes / (64 * 1024 * item), rel=1e-6)


def test_degrees_the_model_cannot_split_are_refused():
    with pytest.raises(PlanError, match="32 attention heads do not split over 3 ranks"):
        negotiate(req(), "nvidia-h200", {"tensor_parallel": 3})
    # 8 KV heads replicate onto 16 ranks (two ranks per head), but not onto 12
    assert negotiate(req(), "nvidia-h200", {"tensor_parallel": 16}).value("tensor_parallel") == 16
    with pytest.raises(PlanError, match="do not split over 12|neither split"):
        negotiate(req(), "nvidia-h200", {"tensor_parallel": 12})
