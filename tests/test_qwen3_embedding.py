"""A Qwen3-Embedding-style directory (a decoder with sentence-transformers' last-token pooling
and Normalize) compiles to an ``embed`` artifact whose embeddings equal sentence-transformers'."""

from __future__ import annotations

import json

import torch
import transformers as T

import portlayer
from portlayer.runtime.engine import LLMEngine

WORDS = "the a man woman is eating playing food bread violin horse riding drums on an enclosed ground".split()
SENTENCES = ["the man is eating food", "a woman is playing violin", "man", "a man is riding a horse on an enclosed "
             "ground " * 3, "drums"]


def _write_dir(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>",
                                     eos_token="<|endoftext|>", padding_side="left")
    torch.manual_seed(0)
    cfg = T.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    T.Qwen3Model(cfg).eval().save_pretrained(path)
    fast.save_pretrained(path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_lasttoken": True}))
    (path / "2_Normalize").mkdir()
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))


def test_qwen3_embedding_dir_compiles_to_embed_artifact(tmp_path):
    from sentence_transformers import SentenceTransformer

    model_dir = tmp_path / "qwen3-embedding-tiny"
    model_dir.mkdir()
    _write_dir(model_dir)
    art = portlayer.compile(str(model_dir), target="cpu-x86_64", output=tmp_path / "art", progress=False)
    assert art.manifest.model["task"] == "embedding"
    emb = LLMEngine.from_artifact(tmp_path / "art").embed(SENTENCES)
    ref = torch.as_tensor(SentenceTransformer(str(model_dir), device="cpu").encode(SENTENCES, convert_to_numpy=True))
    assert emb.shape == ref.shape == (len(SENTENCES), 64)
    cos = torch.nn.functional.cosine_similarity(emb.float(), ref, dim=-1)
    assert cos.min().item() >= 0.99999, cos
    assert torch.allclose(emb.float().norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)
