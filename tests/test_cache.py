"""The content-addressed cache: hits, keys, concurrent compiles, damaged entries, list and clear."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
from artifact_samples import compile_in_child, sample_graph

import portlayer
from portlayer.runtime import cache
from portlayer.runtime.artifact import verify_artifact


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("PORTLAYER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_second_compile_is_a_fast_cache_hit(own_cache: Path) -> None:
    g = sample_graph()
    first = portlayer.compile(g, target="cpu-x86_64", progress=False)
    assert not first.cache_hit and first.path.parent == own_cache / "artifacts"
    t0 = time.perf_counter()
    second = portlayer.compile(g, target="cpu-x86_64", progress=False)
    assert second.cache_hit and second.path == first.path
    assert time.perf_counter() - t0 < max(first.seconds, 1.0)
    assert "cache hit" in str(second)


def test_key_covers_options_target_and_model(own_cache: Path) -> None:
    g = sample_graph()
    a = portlayer.compile(g, target="cpu-x86_64", progress=False).path
    assert portlayer.compile(g, target="cpu-x86_64", dtype="float16", progress=False).path != a
    assert portlayer.compile(g, target="nvidia-h200", progress=False).path != a
    assert portlayer.compile(sample_graph(seed=3), target="cpu-x86_64", progress=False).path != a
    assert len(cache.list_entries()) == 4


def test_output_dir_copies_a_cached_artifact(own_cache: Path, tmp_path: Path) -> None:
    g = sample_graph()
    portlayer.compile(g, target="cpu-x86_64", progress=False)
    out = portlayer.compile(g, target="cpu-x86_64", output=tmp_path / "deploy", progress=False)
    assert out.cache_hit and out.path == (tmp_path / "deploy").resolve()
    verify_artifact(out.path)


def test_damaged_entry_is_rebuilt(own_cache: Path) -> None:
    g = sample_graph()
    first = portlayer.compile(g, target="cpu-x86_64", progress=False)
    (first.path / "plan.json").write_text("{}")
    again = portlayer.compile(g, target="cpu-x86_64", progress=False)
    assert not again.cache_hit and again.path == first.path
    verify_artifact(again.path)


def test_two_concurrent_compiles_leave_one_good_artifact(own_cache: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.starmap(compile_in_child, [(str(own_cache), 2.0), (str(own_cache), 2.0)])
    paths = {p for p, _ in results}
    assert len(paths) == 1, results
    assert sorted(hit for _, hit in results) == [False, True], "exactly one process builds, the other reuses it"
    verify_artifact(Path(paths.pop()))
    leftovers = [p.name for p in (own_cache / "artifacts").iterdir()]
    assert len(leftovers) == 1 and not leftovers[0].startswith("."), leftovers


def test_list_and_clear(own_cache: Path) -> None:
    portlayer.compile(sample_graph(), target="cpu-x86_64", progress=False)
    (entry,) = cache.list_entries()
    assert entry.status == "ok" and entry.target == "cpu-x86_64" and entry.bytes > 0
    assert cache.clear() == 1
    assert cache.list_entries() == []


def test_model_dir_hash_follows_file_content(tmp_path: Path, own_cache: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"abc")
    (d / "model.onnx").write_bytes(b"ignored")
    h1 = cache.model_dir_hash(d)
    (d / "model.onnx").write_bytes(b"still ignored")
    assert cache.model_dir_hash(d) == h1
    time.sleep(0.01)
    (d / "model.safetensors").write_bytes(b"abd")
    assert cache.model_dir_hash(d) != h1
