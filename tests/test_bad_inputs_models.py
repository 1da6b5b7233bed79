"""Bad input, part 2: model directories (weights, config.json) and the capture cache.

A checkpoint that does not match its config must never compile with random or ignored
weights; a damaged file is named; the capture cache is verified like an artifact and a
damaged entry is captured again (the result equal to a fresh capture), with a warning.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from portlayer.flatten.capture import CaptureError, load_hf_model


@pytest.fixture
def qwen(tiny_dirs, tmp_path: Path) -> Path:
    d = tmp_path / "qwen"
    shutil.copytree(tiny_dirs["tiny-qwen3"], d)
    return d


def _edit_weights(d: Path, fn) -> None:
    w = d / "model.safetensors"
    t = dict(load_file(str(w)))
    fn(t)
    save_file(t, str(w), metadata={"format": "pt"})


def _edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"


def test_missing_tensor_that_the_model_uses_is_refused(qwen: Path) -> None:
    from portlayer.flatten import capture

    _edit_weights(qwen, lambda t: t.pop(Q))
    with pytest.raises(CaptureError, match=r"1 tensors the model's outputs use are missing.*" + Q.replace(".", r"\.")):
        capture(qwen)


def test_missing_tensor_only_dead_code_uses_is_accepted(tiny_dirs) -> None:
    """tiny-bert's checkpoint has no pooler; the captured last_hidden_state does not use it."""
    model = load_hf_model(tiny_dirs["tiny-bert"])
    assert set(model._portlayer_missing_weights) == {"pooler.dense.weight", "pooler.dense.bias"}


def test_unexpected_tensor_is_refused(qwen: Path) -> None:
    _edit_weights(qwen, lambda t: t.__setitem__("model.layers.0.extra_adapter.weight", torch.zeros(4, 4)))
    with pytest.raises(CaptureError, match=r"1 tensors in the checkpoint are not part of Qwen3ForCausalLM: "
                                           r"model\.layers\.0\.extra_adapter\.weight"):
        load_hf_model(qwen)


def test_shape_mismatch_is_refused_naming_the_tensor(qwen: Path) -> None:
    _edit_weights(qwen, lambda t: t.__setitem__(K, torch.zeros(t[K].shape[0] + 1, t[K].shape[1])))
    with pytest.raises(CaptureError, match=r"1 tensors do not have the shapes config\.json implies:\s+"
                                           + K.replace(".", r"\.") + r": checkpoint \[33, 64\] vs model \[32, 64\]"):
        load_hf_model(qwen)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weight_is_refused_naming_it(qwen: Path, value: float) -> None:
    def poison(t):
        t[Q] = t[Q].clone()
        t[Q][3, 5] = value

    _edit_weights(qwen, poison)
    with pytest.raises(CaptureError, match=r"1 weight tensors hold NaN or Inf: " + Q.replace(".", r"\.")):
        load_hf_model(qwen)


def test_non_finite_check_can_be_skipped_for_huge_models(qwen: Path, monkeypatch) -> None:
    def poison(t):
        t[Q] = t[Q].clone()
        t[Q][0, 0] = float("nan")

    _edit_weights(qwen, poison)
    monkeypatch.setenv("PORTLAYER_SKIP_WEIGHT_FINITE_CHECK", "1")
    model = load_hf_model(qwen)
    assert torch.isnan(model.state_dict()[Q][0, 0])
    assert load_hf_model(qwen, check_finite=False) is not None


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "huge_header"])
def test_corrupt_safetensors_is_named(qwen: Path, damage: str) -> None:
    w = qwen / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"not a safetensors file" * 3, "empty": b"",
                   "huge_header": (1 << 60).to_bytes(8, "little") + b"{}"}[damage])
    with pytest.raises(CaptureError, match=r"model\.safetensors: not a readable safetensors file"):
        load_hf_model(qwen)


@pytest.mark.parametrize("text,pattern", [
    ("{not json", r"config\.json: not valid JSON"),
    ("[1, 2, 3]", r"config\.json: must hold a JSON object"),
    ('{"hidden_size": 64}', r"config\.json: has no \"model_type\" string"),
    ('{"model_type": "no-such-architecture"}', r"config\.json: model_type 'no-such-architecture' cannot be loaded"),
    ("\udcff".encode("utf-8", "surrogateescape").decode("latin-1"), r"config\.json: not valid JSON"),
    ("[" * 100_000, r"config\.json: not valid JSON"),
])  # fmt: skip
def test_bad_config_json_is_named(qwen: Path, text: str, pattern: str) -> None:
    (qwen / "config.json").write_text(text, encoding="latin-1")
    with pytest.raises(CaptureError, match=pattern):
        load_hf_model(qwen)


def test_config_that_contradicts_the_weights_is_refused(qwen: Path) -> None:
    _edit_config(qwen, lambda c: c.__setitem__("intermediate_size", c["intermediate_size"] * 2))
    with pytest.raises(CaptureError, match=r"tensors do not have the shapes config\.json implies"):
        load_hf_model(qwen)


def test_directory_without_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(CaptureError, match="config.json is missing"):
        load_hf_model(tmp_path)


# ---- the capture cache -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def _one_capture(tiny_dirs, tmp_path_factory):
    import portlayer.build as build
    from portlayer.runtime.cache import model_dir_hash

    cache = tmp_path_factory.mktemp("capture-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PORTLAYER_CACHE", str(cache))
        path = tiny_dirs["tiny-qwen3"]
        sha = model_dir_hash(path)
        graph = build.capture_cached(path, sha, lambda _m: None)
    return cache, path, sha, graph


@pytest.fixture
def entry(_one_capture, tmp_path: Path, monkeypatch):
    """A private copy of a cache holding one verified capture of tiny-qwen3: (entry dir, graph, capture again)."""
    import portlayer.build as build

    cache, path, sha, graph = _one_capture
    shutil.copytree(cache, tmp_path / "cache")
    monkeypatch.setenv("PORTLAYER_CACHE", str(tmp_path / "cache"))
    (e,) = (tmp_path / "cache" / "captured").iterdir()
    return e, graph, lambda: build.capture_cached(path, sha, lambda _m: None)


def _same(a, b) -> bool:
    return list(a.params) == list(b.params) and all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)


def test_capture_cache_entry_is_listed_and_reused(entry) -> None:
    e, graph, again = entry
    doc = json.loads((e / "captured.json").read_text())
    assert doc["format"] == "portlayer.captured" and set(doc["files"]) == {"graph.json", "weights.safetensors"}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _same(again(), graph)


def test_changed_weights_in_capture_cache_are_recaptured_with_a_warning(entry) -> None:
    import portlayer.build as build

    e, graph, again = entry
    t = dict(load_file(str(e / "weights.safetensors")))
    name = next(iter(t))
    t[name] = t[name] + 1.0  # the attack of the issue: different outputs, same validate
    save_file(t, str(e / "weights.safetensors"))
    with pytest.warns(UserWarning, match=r"capture cache entry .* is damaged or was modified .*weights\.safetensors: "
                                         r"sha256 differs"):
        fresh = again()
    assert _same(fresh, graph)
    assert build._load_capture(e, json.loads((e / "captured.json").read_text())["key"]) is not None


@pytest.mark.parametrize("damage,error,pattern", [
    ("extra_file", ValueError, r"files \['evil\.py'\] are not what captured\.json lists"),
    ("no_manifest", FileNotFoundError, r"captured\.json"),
    ("graph_edit", ValueError, r"graph\.json: sha256 differs from captured\.json"),
    ("wrong_key", ValueError, r"not a capture manifest for this key"),
    ("manifest_garbage", RecursionError, r"recursion"),
])  # fmt: skip
def test_damaged_capture_cache_entry_is_refused(entry, damage: str, error: type, pattern: str) -> None:
    import portlayer.build as build

    e, graph, again = entry
    key = json.loads((e / "captured.json").read_text())["key"]
    if damage == "extra_file":
        (e / "evil.py").write_text("x = 1\n")
    elif damage == "no_manifest":
        (e / "captured.json").unlink()
    elif damage == "graph_edit":
        (e / "graph.json").write_text((e / "graph.json").read_text().replace('"rms_norm"', '"layer_norm"', 1))
    elif damage == "wrong_key":
        key = "0" * 64
    else:
        (e / "captured.json").write_text("[" * 50_000)
    with pytest.raises(error, match=pattern):
        build._load_capture(e, key)
