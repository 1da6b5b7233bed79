"""The weights' hash check runs beside their load (issue 20) and is joined before anything uses them.

A tiny Llama compiled for the CPU with per-chunk hashes (chunk sizes made small, as
tests/test_stream_weights.py does) and its weights file treated as big (not held in memory). The
references are outside the code under test: hashlib's view of the file is what the flipped byte changes,
HF's forward gives the logits, the blocking load's outputs are compared bit for bit, and the timestamps
come from spies on the hasher and on the mapping.
"""

from __future__ import annotations

import gc
import os
import shutil
import threading
import time
import weakref

import pytest
import torch

import portlayer
from portlayer.flatten.op_defs.attention import AttentionMetadata
from portlayer.runtime import artifact as A
from portlayer.runtime import file_hash

PROMPT = [5, 17, 200, 3, 99, 42, 7, 1, 250, 64, 11]


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    from artifact_samples import save_tiny_llama

    d = save_tiny_llama(tmp_path_factory.mktemp("overlap") / "model", hidden=96, intermediate=192, max_positions=128)
    with pytest.MonkeyPatch.context() as mp:  # chunk hashes for a file of ~1 MiB: 64 KiB chunks
        mp.setattr(file_hash, "CHUNKED_MIN_BYTES", 1 << 10)
        mp.setattr(file_hash, "CHUNK_BYTES", 1 << 16)
        path = portlayer.compile(d, target="cpu-x86_64", output=d.parent / "art", progress=False).path
    return d, path


@pytest.fixture
def big_weights(art, monkeypatch):
    """Only weights.safetensors is above HOLD_MAX_BYTES: it takes the mapped, background-checked path."""
    _, path = art
    size = (path / A.WEIGHTS).stat().st_size
    others = [p for p in path.rglob("*") if p.is_file() and p.name != A.WEIGHTS and p.stat().st_size >= size]
    assert not others, f"{others} are not smaller than the weights"
    monkeypatch.setattr(A, "HOLD_MAX_BYTES", size - 1)
    monkeypatch.setattr(file_hash, "CHUNKED_MIN_BYTES", 1 << 10)  # the chunk size it was compiled with
    monkeypatch.setattr(file_hash, "CHUNK_BYTES", 1 << 16)
    monkeypatch.delenv("PORTLAYER_VERIFY_WAIT", raising=False)
    return path


def _flipped(src, dst, where: float):
    shutil.copytree(src, dst)
    with open(dst / A.WEIGHTS, "r+b") as f:
        f.seek(0, os.SEEK_END)
        at = int(f.tell() * where) if where < 1 else int(where)
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    return dst


def _logits(exe, ids):
    feeds = {"input_ids": torch.tensor(ids), "positions": torch.arange(len(ids)), "logits_indices": torch.arange(len(ids))}
    with torch.no_grad():
        return exe.run({k: v for k, v in feeds.items() if k in exe.input_names}, AttentionMetadata.single(len(ids)),
                       None)[0]


def _spy_runs(monkeypatch) -> list[str]:
    """Every program step and engine creation, whichever executable the target builds."""
    from portlayer.codegen.host_support import HostProgram
    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.executable import ReferenceExecutable

    calls: list[str] = []
    for cls, name in ((HostProgram, "run"), (ReferenceExecutable, "run"), (LLMEngine, "__init__")):
        orig = getattr(cls, name)

        def spy(self, *a, _orig=orig, _what=f"{cls.__name__}.{name}", **k):
            calls.append(_what)
            return _orig(self, *a, **k)

        monkeypatch.setattr(cls, name, spy)
    return calls


def _spy_builds(monkeypatch) -> list[weakref.ref]:
    """A weak reference to every executable built."""
    from portlayer.codegen.host_support import HostProgram
    from portlayer.runtime.executable import ReferenceExecutable

    refs: list[weakref.ref] = []
    for cls in (HostProgram, ReferenceExecutable):
        def init(self, *a, _orig=cls.__init__, **k):
            refs.append(weakref.ref(self))
            _orig(self, *a, **k)

        monkeypatch.setattr(cls, "__init__", init)
    return refs


def _sha_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("portlayer-sha256")]


@pytest.mark.parametrize("where", [0.5, 12], ids=["data-byte", "header-byte"])
def test_a_flipped_weights_byte_is_refused_before_anything_runs(big_weights, tmp_path, monkeypatch, where):
    """The load returns at once; every path to the weights (executable, engine, graph, validate,
    LLMEngine.from_artifact) raises the blocking check's error naming the file; no step ever ran. A byte
    in the header is reported as a modified file too, not as what mapping the damaged header did."""
    from portlayer.runtime.engine import LLMEngine

    bad = _flipped(big_weights, tmp_path / "bad", where)
    calls = _spy_runs(monkeypatch)
    built = _spy_builds(monkeypatch)
    want = r"weights\.safetensors \(weights\): sha256 differs from the manifest \(modified\)\nRecompile it"
    loaded = portlayer.load(bad)
    assert loaded.manifest.pending is not None  # the check was left running, not done by load()
    with pytest.raises(A.ArtifactError, match=want):
        loaded.executable()
    assert built or where >= 1  # a data byte: the program was built (weights mapped) before the check failed
    gc.collect()
    assert "_mapped_graph" not in loaded.__dict__ and all(ref() is None for ref in built)  # what was built is freed
    for use in (loaded.executable, loaded.engine, lambda: loaded.graph, loaded.validate,
                lambda: LLMEngine.from_artifact(bad)):
        with pytest.raises(A.ArtifactError, match=want):
            use()
    assert calls == []
    assert not _sha_threads()  # the pool lived for the load only
    with pytest.raises(A.ArtifactError, match=want):  # the blocking check: the same text, at verify time
        A.verify_artifact(bad)
    with pytest.raises(A.ArtifactError, match=want):  # inspect only (nothing can run): checked before it returns
        portlayer.load(bad, check_device=False)
    monkeypatch.setenv("PORTLAYER_VERIFY_WAIT", "1")
    with pytest.raises(A.ArtifactError, match=want):
        portlayer.load(bad)
    assert calls == []


def test_untouched_artifact_equals_the_blocking_load_and_validates(art, big_weights, monkeypatch):
    from transformers import LlamaForCausalLM

    d, _ = art
    hf = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        hf_logits = hf(torch.tensor([PROMPT])).logits[0]
    loaded = portlayer.load(big_weights)
    assert loaded.manifest.pending is not None
    got = _logits(loaded.executable(), PROMPT)
    monkeypatch.setenv("PORTLAYER_VERIFY_WAIT", "1")
    blocking = portlayer.load(big_weights)
    assert blocking.manifest.pending is None
    assert torch.equal(got, _logits(blocking.executable(), PROMPT))
    torch.testing.assert_close(got, hf_logits, atol=1e-4, rtol=1e-4)
    assert loaded.validate().ok
    assert not _sha_threads()


def test_the_hash_check_overlaps_the_mapping_and_is_joined_before_the_program_returns(big_weights, monkeypatch, capsys):
    """Each chunk's hash waits (up to 5 s) until the weights have been mapped: a load that hashed
    everything first would only map after those waits, and the order below would be reversed."""
    from portlayer.flatten import weights_stream

    marks: list[tuple[str, float]] = []
    lock, was_mapped = threading.Lock(), threading.Event()
    hash_range, open_st = file_hash._hash_range, weights_stream.open_safetensors

    def gated_hash(path, start, size):
        was_mapped.wait(timeout=5.0)
        h = hash_range(path, start, size)
        with lock:
            marks.append(("hash end", time.perf_counter()))
        return h

    def mapped(path):
        marks.append(("map", time.perf_counter()))
        was_mapped.set()
        return open_st(path)

    monkeypatch.setattr(file_hash, "_hash_range", gated_hash)
    monkeypatch.setattr(weights_stream, "open_safetensors", mapped)
    loaded = portlayer.load(big_weights)
    assert loaded.manifest.pending is not None
    loaded.verify_started -= 5.0  # as if the load had been slow: the progress line is printed
    exe = loaded.executable()
    returned = time.perf_counter()
    ends = [t for what, t in marks if what == "hash end"]
    (map_t,) = [t for what, t in marks if what == "map"]
    assert len(ends) == len(loaded.manifest.files[A.WEIGHTS]["chunks_sha256"])
    assert map_t < min(ends), "a chunk was hashed before the weights were mapped: the load waited for the check"
    assert max(ends) <= returned, "the executable was returned before the hash check finished"
    assert exe is not None and not _sha_threads()
    err = capsys.readouterr().err
    assert "[portlayer] verified art:" in err and "hashed while they were loaded" in err


def test_a_weights_file_replaced_during_the_load_is_refused(big_weights, tmp_path, monkeypatch):
    """The file's inode, size and mtime are taken when its check starts and compared after the hashes:
    touched after it was mapped (while the slowed hashing still runs), the load is refused."""
    from portlayer.flatten import weights_stream

    art = tmp_path / "art"
    shutil.copytree(big_weights, art)
    hash_range, open_st = file_hash._hash_range, weights_stream.open_safetensors
    monkeypatch.setattr(file_hash, "_hash_range", lambda p, s, n: time.sleep(0.02) or hash_range(p, s, n))

    def map_then_touch(path):
        store = open_st(path)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        return store

    monkeypatch.setattr(weights_stream, "open_safetensors", map_then_touch)
    calls = _spy_runs(monkeypatch)
    with pytest.raises(A.ArtifactError, match=r"weights\.safetensors \(weights\): replaced or modified while it was "
                                              r"being verified"):
        portlayer.load(art).executable()
    assert calls == []
