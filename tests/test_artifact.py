"""Artifact format: every file hashed and kinded, tampering refused naming the file, clear errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from artifact_samples import full_artifact, rehash, sample_graph

import portlayer
from portlayer.runtime.artifact import KINDS, ArtifactError, ArtifactWriter, verify_artifact


@pytest.fixture
def art(tmp_path: Path, monkeypatch) -> Path:
    return full_artifact(tmp_path, monkeypatch)


def test_manifest_lists_every_file_with_its_kind(art: Path) -> None:
    m = json.loads((art / "manifest.json").read_text())
    on_disk = {p.relative_to(art).as_posix() for p in art.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(m["files"]) == on_disk
    assert {f["kind"] for f in m["files"].values()} == set(KINDS)
    assert m["files"]["generated/host_program.py"]["kind"] == "source"
    assert m["files"]["tokenizer/tokenizer.json"]["kind"] == "tokenizer"
    for key in ("portlayer", "torch", "triton"):
        assert m["versions"][key]
    assert m["model"]["sha256"] and m["target"]["arch"] == "x86_64" and m["target"]["codegen"] == "torch"
    assert m["stages"]["passes"] and m["codegen"]["generated"] is True
    assert not [p for p in art.parent.iterdir() if ".staging-" in p.name]


@pytest.mark.parametrize("kind", KINDS)
def test_tampered_file_of_each_kind_is_refused_naming_it(art: Path, kind: str) -> None:
    m = verify_artifact(art)
    rel = m.files_of(kind)[0]
    p = art / rel
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, different content
    p.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"(?s)failed verification.*" + rel.replace(".", r"\.") + r".*modified"):
        portlayer.load(art)


def test_missing_and_unlisted_files_are_refused(art: Path) -> None:
    (art / "plan.json").unlink()
    (art / "generated" / "extra.py").write_text("print('hi')\n")
    with pytest.raises(ArtifactError) as e:
        portlayer.load(art)
    assert "plan.json (plan): missing" in str(e.value)
    assert "generated/extra.py: not listed in the manifest" in str(e.value)
    assert "portlayer compile tiny-test --target cpu-x86_64" in str(e.value)


def test_planted_pycache_is_refused(art: Path) -> None:
    (art / "generated" / "__pycache__").mkdir()
    (art / "generated" / "__pycache__" / "host_program.cpython-311.pyc").write_bytes(b"\0")
    with pytest.raises(ArtifactError, match=r"generated/__pycache__/host_program\.cpython-311\.pyc: not listed"):
        verify_artifact(art)


def test_truncated_safetensors(art: Path) -> None:
    w = art / "weights.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(ArtifactError, match=r"weights\.safetensors \(weights\): \d+ bytes, manifest says \d+ \(truncated"):
        portlayer.load(art)
    rehash(art)  # even with a re-signed manifest the file itself is refused when read
    loaded = portlayer.load(art)
    with pytest.raises(ArtifactError, match=r"weights\.safetensors: not a readable safetensors file"):
        loaded.graph  # noqa: B018


def test_malformed_manifest_json(art: Path) -> None:
    (art / "manifest.json").write_text('{"format": "portlayer.artifact", ')
    with pytest.raises(ArtifactError, match=r"manifest\.json: not valid JSON"):
        portlayer.load(art)
    (art / "manifest.json").write_text('{"format": "something-else"}')
    with pytest.raises(ArtifactError, match=r"format is 'something-else'"):
        portlayer.load(art)
    (art / "manifest.json").write_text('{"format": "portlayer.artifact", "format_version": 1, "files": []}')
    with pytest.raises(ArtifactError, match=r"'files' must map each path"):
        portlayer.load(art)


def test_malformed_plan_json(art: Path) -> None:
    (art / "plan.json").write_text("{not json")
    rehash(art)
    with pytest.raises(ArtifactError, match=r"plan\.json: not valid JSON .*recompile"):
        portlayer.load(art)
    (art / "plan.json").write_text('{"model": "x"}')
    rehash(art)
    with pytest.raises(ArtifactError, match=r"plan\.json: not a plan \(KeyError"):
        portlayer.load(art)


def test_malformed_capability_json(art: Path) -> None:
    (art / "capability.json").write_text('{"name": "x"}')
    rehash(art)
    with pytest.raises(ArtifactError, match=r"(?s)capability\.json.*descriptor is damaged"):
        portlayer.load(art)


def test_missing_directory_and_not_an_artifact(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="no such artifact directory"):
        portlayer.load(tmp_path / "nope")
    with pytest.raises(ArtifactError, match=r"manifest\.json: missing"):
        portlayer.load(tmp_path)


def test_toolkit_version_difference_is_reported(art: Path) -> None:
    m = json.loads((art / "manifest.json").read_text())
    m["versions"]["torch"] = "1.0.0"
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.warns(UserWarning, match=r"torch 1\.0\.0 built this artifact"):
        loaded = portlayer.load(art)
    assert any("recompile" in n for n in loaded.notes)


def test_writer_is_atomic(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with pytest.raises(RuntimeError), ArtifactWriter(final) as w:
        (w.dir / "graph.json").write_text("{}")
        raise RuntimeError("crash mid-write")
    assert not final.exists() and os.listdir(tmp_path) == []


def test_output_over_a_non_artifact_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="is not a portlayer artifact"):
        portlayer.compile(sample_graph(), target="cpu-x86_64", output=tmp_path / "mine", progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]


def test_validate_passes_on_cpu_and_catches_a_wrong_program(tmp_path: Path) -> None:
    art = portlayer.compile(sample_graph(), target="cpu-x86_64", output=tmp_path / "a", progress=False)
    loaded = portlayer.load(art.path)
    report = loaded.validate()
    assert report.ok, report.format_table()
    assert {r.case for r in report.rows} == {"prefill", "packed", "decode"}
    assert "PASSED" in report.format_table()

    from portlayer.runtime.executable import ReferenceExecutable

    other = ReferenceExecutable(sample_graph(seed=1))  # same shapes, different weights
    bad = loaded.validate(other)
    assert not bad.ok and "FAIL" in bad.format_table()


def test_loaded_artifact_exposes_graph_plan_descriptor(tmp_path: Path) -> None:
    art = portlayer.compile(sample_graph(), target="cpu-x86_64", output=tmp_path / "a", progress=False)
    loaded = art.load()
    assert loaded.descriptor.name == "cpu-x86_64"
    assert loaded.plan.target == "cpu-x86_64"
    assert loaded.graph.outputs == sample_graph().outputs
    assert loaded.executable().device.type == "cpu"
    assert "Plan for" in loaded._repr_html_()
