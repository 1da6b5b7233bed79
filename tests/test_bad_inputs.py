"""Bad input, part 1: artifacts as an attacker or a careless user leaves them, and `-o DIR`.

Every case asserts the exact outcome (refused with a message naming the file and the fix,
or correct behaviour checked against the validation set the reference interpreter computed
at compile time) and that nothing was lost (the files still there, byte for byte).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bad_input_samples import compile_sample, copy_artifact, edit_manifest, tree

import portlayer
from portlayer.runtime.artifact import ArtifactError, verify_artifact


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-inputs")
    return {"cpu": compile_sample(root / "cpu"), "h200": compile_sample(root / "h200", "nvidia-h200", dtype="float32")}


@pytest.fixture
def art(built, tmp_path) -> Path:
    return copy_artifact(built["cpu"], tmp_path / "art")


@pytest.fixture
def tart(built, tmp_path) -> Path:
    return copy_artifact(built["h200"], tmp_path / "tart")


def refused(art: Path, pattern: str) -> str:
    with pytest.raises(ArtifactError, match=pattern) as e:
        portlayer.load(art)
    return str(e.value)


# ---- generated code runs only from verified bytes -------------------------------------------
@pytest.mark.parametrize("rel", ["__pycache__/host.cpython-311.pyc", "kernels/__pycache__/x.cpython-311.pyc",
                                 "__pycache__/host.cpython-312.opt-1.pyc", "sitecustomize.py", "kernels/extra.py",
                                 "tokenizer/evil.json", ".hidden"])
def test_unlisted_file_is_refused(art: Path, rel: str) -> None:
    (art / rel).parent.mkdir(parents=True, exist_ok=True)
    (art / rel).write_bytes(b"raise SystemExit('planted code ran')\n")
    msg = refused(art, "failed verification")
    assert f"{rel}: not listed in the manifest" in msg and "Recompile it" in msg


def test_unlisted_symlink_is_refused(art: Path) -> None:
    (art / "link.py").symlink_to(art / "host.py")
    assert "link.py: not listed" in refused(art, "failed verification")


def test_listed_file_replaced_by_symlink_is_refused(art: Path, tmp_path: Path) -> None:
    outside = tmp_path / "host_copy.py"
    outside.write_bytes((art / "host.py").read_bytes())  # identical bytes: the hash alone would pass
    (art / "host.py").unlink()
    (art / "host.py").symlink_to(outside)
    assert "host.py (source): a symbolic link" in refused(art, "failed verification")


def test_listed_fifo_is_refused_without_blocking(art: Path) -> None:
    (art / "plan.json").unlink()
    os.mkfifo(art / "plan.json")
    assert "plan.json (plan): missing" in refused(art, "failed verification")


def test_empty_directory_is_harmless(art: Path) -> None:
    (art / "kernels").mkdir(exist_ok=True)
    assert portlayer.load(art).validate().ok


def test_host_edited_after_load_does_not_run(art: Path) -> None:
    loaded = portlayer.load(art)
    (art / "host.py").write_text("raise SystemExit('edited host.py ran')\n")
    report = loaded.validate(loaded.executable())  # the bytes load() verified
    assert report.ok
    refused(art, r"host\.py \(source\): \d+ bytes, manifest says|host\.py \(source\): sha256 differs")


def test_graph_edited_after_load_is_not_used(art: Path) -> None:
    loaded = portlayer.load(art)
    before = len(json.loads((art / "graph.json").read_text())["nodes"])
    (art / "graph.json").write_text('{"format": "portlayer.flat_ir"}')
    assert len(loaded.graph.nodes) == before and loaded.validate().ok


def _flip_last_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))


def test_small_weights_replaced_after_load_are_not_used(art: Path) -> None:
    from safetensors.torch import load_file

    original = {k: v.clone() for k, v in load_file(str(art / "weights.safetensors")).items()}
    loaded = portlayer.load(art)
    _flip_last_byte(art / "weights.safetensors")
    assert all((loaded.graph.weights[k] == v).all() for k, v in original.items())


def test_large_weights_replaced_after_load_are_refused(art: Path, monkeypatch) -> None:
    import portlayer.runtime.artifact as A

    monkeypatch.setattr(A, "HOLD_MAX_BYTES", 4096)  # weights above it are re-checked when read, not held
    loaded = portlayer.load(art)
    assert "weights.safetensors" not in loaded.manifest.held
    _flip_last_byte(art / "weights.safetensors")
    with pytest.raises(ArtifactError, match=r"weights\.safetensors \(weights\): changed since the artifact was verified"):
        loaded.graph  # noqa: B018


def test_triton_kernel_edited_after_verification_does_not_run(tart: Path, monkeypatch) -> None:
    """Interpreter tier: @triton.jit reads the verified text through linecache, not the edited file."""
    from triton_harness import use_interpreter

    from portlayer.codegen.program import load_program
    from portlayer.runtime.artifact import verified_sources

    use_interpreter(monkeypatch)
    loaded = portlayer.load(tart, check_device=False)
    sources = verified_sources(loaded.manifest)
    for p in (tart / "kernels").glob("*.py"):
        text = p.read_text()
        p.write_text(text.replace("tl.store(", "tl.device_assert(False, 'edited'); tl.store(", 1))
    prog = load_program(tart, loaded.graph.weights, "cpu", sources=sources, max_tokens=32, max_seqs=4)
    report = loaded.validate(prog)
    assert report.ok, report.format_table()
    assert any(k.startswith("<portlayer-artifact ") for k in __import__("linecache").cache)


def test_triton_kernels_from_verified_bytes_compile_ahead_of_time(tart: Path) -> None:
    """Compiled tier (a process without TRITON_INTERPRET): the same loader feeds triton.compile for sm_90."""
    code = (
        "import sys, json\n"
        "from pathlib import Path\n"
        "from portlayer.runtime.artifact import verify_artifact, verified_sources\n"
        "from portlayer.codegen.source_loader import module_name\n"
        "import triton\nfrom triton.backends.compiler import GPUTarget\n"
        "art = Path(sys.argv[1]); m = verify_artifact(art); src = verified_sources(m)\n"
        "info = json.loads(m.held['kernels.json'])['kernels']\n"
        "name, k = sorted(info.items())[0]\n"
        "path = art / 'kernels' / (k['module'] + '.py')\n"
        "path.write_text('raise SystemExit(3)\\n')  # the disk copy is never read again\n"
        "mod = src.exec_module(path, module_name(src, path, 'aot'))\n"
        "c = triton.compile(triton.compiler.ASTSource(getattr(mod, k['fn']), signature=dict(k['signature']),"
        " constexprs=dict(k['constexprs'])), target=GPUTarget('cuda', 90, 32), options={'num_warps': k['num_warps']})\n"
        "print('cubin', len(c.asm['cubin']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code, str(tart)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert int(p.stdout.split()[-1]) > 1000


# ---- the manifest itself ----------------------------------------------------------------------
@pytest.mark.parametrize("rel,pattern", [
    ("../outside.json", "path escapes the artifact directory"),
    ("/etc/passwd", "path escapes the artifact directory"),
    ("manifest.json", "path escapes the artifact directory"),
])  # fmt: skip
def test_manifest_paths_outside_the_artifact_are_refused(art: Path, rel: str, pattern: str) -> None:
    edit_manifest(art, lambda m: m["files"].__setitem__(rel, {"kind": "source", "sha256": "0" * 64, "bytes": 1}))
    assert pattern in refused(art, "failed verification")


@pytest.mark.parametrize("text,pattern", [
    ("", "not valid JSON"),
    ("[" * 100_000, "not valid JSON"),
    ("[1, 2]", "format is 'list'"),
    ('{"format": "portlayer.artifact", "format_version": 99}', "format_version 99"),
    ('{"format": "webapp"}', "format is 'webapp'"),
    ('{"format": "portlayer.artifact", "format_version": 1, "files": []}', "'files' must map"),
    ('{"format": "portlayer.artifact", "format_version": 1, "files": {"a": {"kind": "exe", "sha256": "x"}}}',
     "'files' must map"),
    ('{"format": "portlayer.artifact", "format_version": 1, "files": {}}', r"graph\.json: not listed in the manifest"),
])  # fmt: skip
def test_malformed_manifest_is_refused(art: Path, text: str, pattern: str) -> None:
    (art / "manifest.json").write_text(text)
    refused(art, pattern)


def test_manifest_missing_or_path_not_a_dir(art: Path, tmp_path: Path) -> None:
    (art / "manifest.json").unlink()
    refused(art, "manifest.json: missing")
    (tmp_path / "f").write_text("x")
    refused(tmp_path / "f", "not a directory")
    refused(tmp_path / "nope", "no such artifact directory")


def test_truncated_weights_are_refused(art: Path) -> None:
    w = art / "weights.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    refused(art, r"weights\.safetensors \(weights\): 100 bytes, manifest says \d+ \(truncated")


def test_tampered_graph_kernels_are_caught_by_the_verifier(art: Path) -> None:
    """Even with a re-signed manifest, a graph whose kernel groups skip a node is refused on use."""
    from artifact_samples import rehash

    doc = json.loads((art / "graph.json").read_text())
    doc["meta"]["kernels"][0]["nodes"] = []
    (art / "graph.json").write_text(json.dumps(doc))
    rehash(art)
    loaded = portlayer.load(art)
    with pytest.raises(ArtifactError, match=r"(?s)graph\.json: graph verification.*holds no nodes.*in no kernel group"):
        loaded.graph  # noqa: B018


def test_tokenizer_dir_with_only_generation_config_means_no_tokenizer(art: Path) -> None:
    assert portlayer.load(art).tokenizer() is None  # the sample has no tokenizer files at all


# ---- -o DIR replaces only an artifact or an empty directory --------------------------------
def _foreign(d: Path, manifest: str | None) -> dict[str, bytes]:
    d.mkdir(parents=True)
    (d / "index.html").write_text("<h1>my web app</h1>")
    if manifest is not None:
        (d / "manifest.json").write_text(manifest)
    return tree(d)


@pytest.mark.parametrize("manifest", [None, '{"name": "my-pwa", "start_url": "/"}', "{broken", '{"format": "other"}'])
def test_output_dir_that_is_not_an_artifact_is_refused_and_kept(tmp_path: Path, manifest: str | None) -> None:
    from portlayer.api import CompileError  # noqa: F401 - the refusal is an ArtifactError, also a PortlayerError

    out = tmp_path / "site"
    before = _foreign(out, manifest)
    with pytest.raises(ArtifactError, match=r"exists and is not a portlayer artifact.*nothing was written or removed"):
        compile_sample(out)
    assert tree(out) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_output_path_that_is_a_file_is_refused_and_kept(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    with pytest.raises(ArtifactError, match="is a file, not an artifact directory"):
        compile_sample(f)
    assert f.read_text() == "keep me"


def test_output_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ArtifactError, match="is a symbolic link"):
        compile_sample(tmp_path / "link")
    assert list((tmp_path / "real").iterdir()) == []


def test_output_empty_dir_and_existing_artifact_are_replaced(built, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert verify_artifact(compile_sample(empty)).files
    old = copy_artifact(built["cpu"], tmp_path / "old")
    (old / "host.py").write_text("# stale\n")  # a damaged artifact is still an artifact: replaced
    assert portlayer.load(compile_sample(old)).validate().ok
