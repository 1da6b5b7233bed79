"""Task inference without ``architectures``: transformers' auto-model tables decide, loading agrees."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from portlayer.flatten.task import TaskInferenceError, infer_task


@pytest.mark.parametrize("cfg, task", [
    (transformers.LlamaConfig(), "causal_lm"),
    (transformers.Qwen3Config(), "causal_lm"),
    (transformers.GPT2Config(), "causal_lm"),
    (transformers.BertConfig(), "encoder"),
    (transformers.BertConfig(is_decoder=True), "causal_lm"),
    (transformers.LlamaConfig(architectures=["LlamaModel"]), "encoder"),
])  # fmt: skip
def test_infer_task_from_model_type(cfg, task):
    assert infer_task(cfg) == task


def test_unknown_model_type_is_a_clear_error():
    cfg = transformers.PretrainedConfig()
    cfg.model_type = "no-such-family"
    with pytest.raises(TaskInferenceError, match="architectures"):
        infer_task(cfg)


def test_llama_dir_without_architectures_captures_as_causal_lm(tmp_path):
    from portlayer.flatten import capture, interpret

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    doc = json.loads((tmp_path / "config.json").read_text())
    doc.pop("architectures", None)
    (tmp_path / "config.json").write_text(json.dumps(doc))
    g = capture(tmp_path)
    assert g.meta["task"] == "causal_lm"
    ids = torch.tensor([3, 5, 7, 11])
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    torch.testing.assert_close(interpret(g, ids), ref, atol=1e-4, rtol=1e-4)
