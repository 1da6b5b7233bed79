"""graph.json + weights.safetensors: exact round trips, tied weights, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ir_samples import tiny_decoder
from safetensors import safe_open

from portlayer.flatten.ir import GraphBuilder, TensorType
from portlayer.flatten.printer import print_graph
from portlayer.flatten.serialize import (
    FORMAT_VERSION,
    GraphFileError,
    graph_from_json,
    graph_to_json,
    load_graph,
    save_graph,
)
from portlayer.flatten.verify import verify_graph


def test_round_trip_printout_and_tensors(tmp_path: Path) -> None:
    g = tiny_decoder()
    save_graph(g, tmp_path / "g")
    back = load_graph(tmp_path / "g")
    assert print_graph(back, show_meta=True) == print_graph(g, show_meta=True)
    assert back.meta == g.meta and list(back.weights) == list(g.weights)
    for name, t in g.weights.items():
        assert back.weights[name].dtype == t.dtype and torch.equal(back.weights[name], t), name
    verify_graph(back)
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == ["graph.json", "weights.safetensors"]


def test_tied_weights_stored_once_and_stay_tied(tmp_path: Path) -> None:
    g = tiny_decoder(tied=True)
    assert g.weights["lm_head_weight"] is g.weights["model_embed_tokens_weight"]
    save_graph(g, tmp_path)
    with safe_open(str(tmp_path / "weights.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model_embed_tokens_weight" in keys and "lm_head_weight" not in keys
    doc = json.loads((tmp_path / "graph.json").read_text())
    assert doc["weights"]["aliases"] == {"lm_head_weight": "model_embed_tokens_weight"}
    back = load_graph(tmp_path)
    assert back.weights["lm_head_weight"] is back.weights["model_embed_tokens_weight"]


def test_views_of_one_fused_tensor_and_odd_dtypes(tmp_path: Path) -> None:
    fused = torch.randn(12, 4)
    b = GraphBuilder()
    x = b.add_input("x", TensorType("float32", ("num_tokens", 4)))
    ws = {
        "q": fused[:4], "k": fused[4:8], "v_t": fused[8:].t(),  # views sharing one storage
        "bf": torch.randn(3, 2).bfloat16(), "i8": torch.randint(-128, 127, (5,), dtype=torch.int8),
        "mask": torch.rand(2, 2) > 0.5, "scalar": torch.tensor(2.5, dtype=torch.float64), "empty": torch.zeros(0, 4),
    }
    for k, t in ws.items():
        b.add_param(k, t)
    b.graph.outputs = [b.add1("linear", [x, "q"])]
    save_graph(b.graph, tmp_path)
    back = load_graph(tmp_path)
    for k, t in ws.items():
        assert back.weights[k].dtype == t.dtype and back.weights[k].shape == t.shape and torch.equal(back.weights[k], t), k


def test_graph_without_weights(tmp_path: Path) -> None:
    g = tiny_decoder()
    g.weights = {}
    save_graph(g, tmp_path)
    back = load_graph(tmp_path)
    assert back.weights == {} and back.params == g.params


def test_json_round_trip_through_text() -> None:
    b = GraphBuilder()
    b.add_input("x", TensorType("float32", ("num_tokens", 4)))
    f = b.add1("full", [], {"shape": ["2*num_tokens"], "value": float("-inf")}, meta={"kernel_group": 3})
    b.graph.outputs = [f]
    d = graph_to_json(b.graph)
    assert d["format_version"] == FORMAT_VERSION and d["params"] == []
    back = graph_from_json(json.loads(json.dumps(d)))
    assert print_graph(back, show_meta=True) == print_graph(b.graph, show_meta=True)
    assert back.nodes[0].attrs["value"] == float("-inf")


def test_weights_file_is_not_a_pickle(tmp_path: Path) -> None:
    save_graph(tiny_decoder(), tmp_path)
    head = (tmp_path / "weights.safetensors").read_bytes()
    n = int.from_bytes(head[:8], "little")  # safetensors: u64 header length, then a JSON header
    assert head[8:9] == b"{" and json.loads(head[8:8 + n])["__metadata__"]["format"] == "pt"


def test_stray_weight_is_refused(tmp_path: Path) -> None:
    g = tiny_decoder()
    g.weights["orphan"] = torch.zeros(2)
    with pytest.raises(ValueError, match="orphan"):
        save_graph(g, tmp_path)


# ---- errors name the file and what was expected ------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    save_graph(tiny_decoder(), tmp_path)
    return tmp_path


def test_missing_graph_json(tmp_path: Path) -> None:
    with pytest.raises(GraphFileError, match=r"graph\.json: not found; expected .*save_graph"):
        load_graph(tmp_path / "nowhere")


def test_corrupt_graph_json(saved: Path) -> None:
    (saved / "graph.json").write_text('{"format": "portlayer.flat_ir", ')
    with pytest.raises(GraphFileError, match=r"graph\.json: not valid JSON"):
        load_graph(saved)


def test_wrong_format_and_version(saved: Path) -> None:
    doc = json.loads((saved / "graph.json").read_text())
    (saved / "graph.json").write_text(json.dumps({**doc, "format_version": 99}))
    with pytest.raises(GraphFileError, match="format_version 99 is not supported"):
        load_graph(saved)
    (saved / "graph.json").write_text(json.dumps({"nodes": []}))
    with pytest.raises(GraphFileError, match="expected a dict with format="):
        load_graph(saved)


def test_incomplete_graph_json(saved: Path) -> None:
    doc = json.loads((saved / "graph.json").read_text())
    del doc["nodes"]
    (saved / "graph.json").write_text(json.dumps(doc))
    with pytest.raises(GraphFileError, match="missing key 'nodes'"):
        load_graph(saved)


def test_missing_weights_file(saved: Path) -> None:
    (saved / "weights.safetensors").unlink()
    with pytest.raises(GraphFileError, match=r"weights\.safetensors: not found; graph\.json lists 13 weights"):
        load_graph(saved)


def test_corrupt_weights_file(saved: Path) -> None:
    data = (saved / "weights.safetensors").read_bytes()
    (saved / "weights.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(GraphFileError, match=r"weights\.safetensors: not a readable safetensors file"):
        load_graph(saved)


def test_weights_that_do_not_match_the_params(saved: Path) -> None:
    doc = json.loads((saved / "graph.json").read_text())
    doc["params"][0]["shape"] = [99, 16]
    (saved / "graph.json").write_text(json.dumps(doc))
    with pytest.raises(GraphFileError, match=r"is float32\[32, 16\] but param 'model_embed_tokens_weight' is declared"):
        load_graph(saved)
