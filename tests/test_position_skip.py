"""RoBERTa-style positions: the model numbers a sequence's tokens leaving its padding id out (HF's
create_position_ids_from_input_ids). Capture finds the rule by probing the model (flatten/capture.py
position_skip_token); the runtime numbers embedding inputs so (a padding id inside a text shifted every later
position before); generation refuses a prompt holding it. Checked against Hugging Face's own forward."""

from __future__ import annotations

import pytest
import torch
import transformers as T

import portlayer
from portlayer.flatten import capture
from portlayer.runtime.engine import LLMEngine
from portlayer.runtime.sequence import RequestRejected, SamplingParams


def _roberta():
    torch.manual_seed(0)
    cfg = T.RobertaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=140)
    return T.RobertaModel(cfg).eval()


def test_capture_finds_the_skipped_token_and_only_where_the_model_skips_one():
    assert capture(_roberta()).meta["position_skip_token"] == 1  # RoBERTa's padding id
    torch.manual_seed(0)
    bert = T.BertModel(T.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, pad_token_id=0)).eval()
    assert "position_skip_token" not in capture(bert).meta  # BERT numbers every token


def test_embedding_a_text_with_the_padding_id_inside_matches_hf(tmp_path):
    model = _roberta()
    art = tmp_path / "art"
    portlayer.compile(model, target="cpu-x86_64", output=art, progress=False)
    engine = LLMEngine.from_artifact(art)
    texts = [[0, 15, 1, 40, 41, 1, 1, 77, 2], [0, 9, 10, 11, 2], [1, 30, 31, 2]]  # pads inside, none, first
    got = engine.embed(texts)
    with torch.no_grad():
        want = torch.stack([model(torch.tensor([t])).last_hidden_state[0].mean(0) for t in texts])
    torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-4)


def test_generation_refuses_a_prompt_holding_the_skipped_token():
    engine = LLMEngine.from_model("tiny-qwen3")
    engine.meta["position_skip_token"] = 7  # as a RoBERTa-style causal LM's graph would say
    with pytest.raises(RequestRejected, match="token 7 at position 2"):
        engine.add_request([3, 4, 7, 5], SamplingParams(max_tokens=1))
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=1))  # others go on
