"""Encoder / embedding models compiled for ascend-910b run on the CPU emulator of torch_npu and
give sentence-transformers' embeddings. No KV cache: attention is the plain (PrefillNoCache) FIA
call where the TND head-dim rule admits the model (head_dim 64), the reference op otherwise.
Nothing here ran on an NPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as T

import portlayer
from portlayer.runtime.engine import LLMEngine

WORDS = "the a man woman is eating playing food bread violin horse riding drums on an enclosed ground".split()
SENTENCES = ["the man is eating food", "a woman is playing violin", "man",
             "a man is riding a horse on an enclosed ground " * 3, "drums"]


def _st_dir(path: Path, model: torch.nn.Module, pooling: str, bert: bool) -> Path:
    """A sentence-transformers directory: the HF model, a word-level tokenizer, pooling (+ Normalize)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] if bert else ["<unk>", "<|endoftext|>"]
    vocab = {**{s: i for i, s in enumerate(specials)}, **{w: i + len(specials) for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[1] if bert else specials[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bert:
        tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
        fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                         sep_token="[SEP]")
    else:
        fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>",
                                         eos_token="<|endoftext|>", padding_side="left")
    model.eval().save_pretrained(path)
    fast.save_pretrained(path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    modes = {f"pooling_mode_{m}": m == pooling for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
                                                          "lasttoken")}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": model.config.hidden_size,
                                                                 **modes}))
    (path / "2_Normalize").mkdir()
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    return path


def _bert_hd64(path: Path) -> Path:
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=32, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                       max_position_embeddings=128)
    return _st_dir(path, T.BertModel(cfg), "mean_tokens", bert=True)


def _qwen3_embedding_hd64(path: Path) -> Path:
    torch.manual_seed(0)
    cfg = T.Qwen3Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=64, max_position_embeddings=256)
    return _st_dir(path, T.Qwen3Model(cfg), "lasttoken", bert=False)


def _check(model_dir: Path, art_dir: Path, dtype: str, sentences: list[str], min_cos: float, calls_fia: bool) -> None:
    from sentence_transformers import SentenceTransformer

    art = portlayer.compile(str(model_dir), target="ascend-910b", dtype=dtype, output=art_dir, progress=False)
    assert art.manifest.model["task"] == "embedding"
    eng = LLMEngine.from_artifact(art_dir, emulate=True)
    emb = eng.embed(sentences)
    ref = torch.as_tensor(SentenceTransformer(str(model_dir), device="cpu").encode(sentences, convert_to_numpy=True))
    assert emb.shape == ref.shape
    cos = torch.nn.functional.cosine_similarity(emb.float(), ref.float(), dim=-1)
    assert cos.min().item() >= min_cos, cos
    calls = eng.executable.npu.calls
    assert ("npu_fused_infer_attention_score" in calls) == calls_fia, calls
    assert "_npu_paged_attention" not in calls and "npu_scatter_pa_kv_cache" not in calls  # no KV cache


@pytest.mark.parametrize("dtype,min_cos", [("float16", 0.999), ("float32", 0.99999)])
def test_bert_encoder_on_910b_emulator(tmp_path, dtype, min_cos):
    d = tmp_path / "bert"
    d.mkdir()
    _check(_bert_hd64(d), tmp_path / "art", dtype, SENTENCES, min_cos, calls_fia=dtype == "float16")


def test_qwen3_embedding_on_910b_emulator(tmp_path):
    d = tmp_path / "qwen3-emb"
    d.mkdir()
    _check(_qwen3_embedding_hd64(d), tmp_path / "art", "float16", SENTENCES, 0.999, calls_fia=True)


def test_minilm_real_weights_on_910b_emulator(minilm_dir, tmp_path):
    """all-MiniLM-L6-v2 (head_dim 32: FIA's TND rule refuses it, attention is the reference op)."""
    sentences = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."]
    _check(minilm_dir, tmp_path / "art", "float16", sentences, 0.999, calls_fia=False)
