"""Issue 20, compile time: hashes computed while writing and in parallel chunks keep their guarantees,
and the validation set computed beside codegen is the serial one, bit for bit.

Expected digests come from hashlib over the file's bytes as read back here; expected tensors from
safetensors' own reader and from the serial compile of the same model.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from portlayer.flatten import weights_stream as WS
from portlayer.runtime import cache, file_hash


def _chunk_shas(data: bytes, cb: int) -> list[str]:
    return [hashlib.sha256(data[i:i + cb]).hexdigest() for i in range(0, len(data), cb)]


def _no_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: object) -> str:
        raise AssertionError("the file was read again")

    monkeypatch.setattr(file_hash, "_hash_range", refuse)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    cb = 1 << 12
    monkeypatch.setattr(WS, "HASH_CHUNK_BYTES", cb)
    monkeypatch.setattr(file_hash, "CHUNK_BYTES", cb)
    monkeypatch.setattr(file_hash, "CHUNKED_MIN_BYTES", 1 << 10)
    return cb


def test_hashes_made_while_writing_are_hashlibs_and_a_changed_file_is_hashed_again(tmp_path, small_chunks, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(257, 33, generator=g)
    tensors = {f"t{i}": (WS.cast(x * i, torch.bfloat16) if i % 2 else x[:, i:]) for i in range(9)}
    tensors["empty"] = torch.zeros(0, 3)
    path = tmp_path / "w.safetensors"
    n = WS.write_tensors(path, tensors.items(), threads=3, in_flight_bytes=40_000)  # several tensors in flight
    data = path.read_bytes()
    assert n == len(data)
    back = load_file(str(path))
    for name, v in tensors.items():
        assert torch.equal(back[name], v() if isinstance(v, WS.Lazy) else v), name
    with monkeypatch.context() as m:
        _no_reads(m)
        got = file_hash.hashes(path)
    assert got == {"sha256": _tree(data, small_chunks), "chunk_bytes": small_chunks,
                   "chunks_sha256": _chunk_shas(data, small_chunks)}
    with open(path, "r+b") as f:  # one byte changed: the digests made at write time no longer apply
        f.seek(len(data) // 2)
        f.write(bytes([data[len(data) // 2] ^ 1]))
    bad = path.read_bytes()
    assert file_hash.hashes(path)["sha256"] == _tree(bad, small_chunks) != got["sha256"]
    assert file_hash.chunks_match(path, got) is False
    forged = {**got, "chunks_sha256": _chunk_shas(bad, small_chunks)}  # chunks of the new bytes, old digest
    assert file_hash.chunks_match(path, forged) is False


def _tree(data: bytes, cb: int) -> str:
    """A big file's manifest digest, from hashlib: sha256 of "<chunk bytes>:" + its chunks' hex digests."""
    return "chunks:" + hashlib.sha256(f"{cb}:".encode() + "".join(_chunk_shas(data, cb)).encode()).hexdigest()


def test_a_big_file_is_hashed_in_parallel_chunks_only_and_a_small_one_whole(tmp_path, small_chunks, monkeypatch):
    """No serial whole-file pass over a file of WHOLE_HASH_MAX_BYTES or more (13 s of an 8B compile); a
    smaller file keeps its plain sha256. Both as hashlib computes them from the bytes read back."""
    monkeypatch.setattr(WS, "WHOLE_HASH_MAX_BYTES", 1 << 14)
    g = torch.Generator().manual_seed(1)
    for name, rows in (("big", 300), ("small", 3)):
        tensors = {f"t{i}": torch.randn(rows, 17, generator=g) for i in range(5)}
        path = tmp_path / f"{name}.safetensors"
        WS.write_tensors(path, tensors.items(), threads=4, in_flight_bytes=30_000)
        data = path.read_bytes()
        known = WS.written_hashes(path)
        assert known["chunks_sha256"] == _chunk_shas(data, small_chunks)
        assert ("sha256" in known) == (len(data) < WS.WHOLE_HASH_MAX_BYTES)
        if "sha256" in known:
            assert known["sha256"] == hashlib.sha256(data).hexdigest()
        with monkeypatch.context() as m:
            _no_reads(m)
            got = file_hash.hashes(path)
        assert got["sha256"] == _tree(data, small_chunks)  # both over CHUNKED_MIN_BYTES (1 KiB here)
        assert file_hash.chunks_match(path, got) is True


def test_model_hash_is_parallel_chunks_memoised_by_stat_and_follows_every_byte(tmp_path, small_chunks, monkeypatch):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    blob = os.urandom(5 * small_chunks + 123)
    w = d / "model.safetensors"
    w.write_bytes(blob)
    h1 = cache.model_dir_hash(d)
    other = tmp_path / "other"  # same names, other weights: never the same key
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    (other / "model.safetensors").write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    assert cache.model_dir_hash(other) != h1
    with monkeypatch.context() as m:  # memoised: nothing is read for an unchanged file
        _no_reads(m)
        assert cache.model_dir_hash(d) == h1
        assert cache.needs_hashing(d) == 0
    st = w.stat()
    with open(w, "r+b") as f:  # a byte changed and the old mtime put back: ctime still says it changed
        f.seek(3 * small_chunks + 7)
        f.write(bytes([blob[3 * small_chunks + 7] ^ 0x80]))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cache.needs_hashing(d) == w.stat().st_size
    assert cache.model_dir_hash(d) != h1
    w.write_bytes(blob)  # the original bytes again: the original key
    assert cache.model_dir_hash(d) == h1
    # the digest is hashlib's over the chunks, independent of the pool's order
    tree = hashlib.sha256(f"{small_chunks}:".encode() + "".join(_chunk_shas(blob, small_chunks)).encode()).hexdigest()
    assert file_hash.content_digests([w, d / "config.json"]) == [
        "chunks:" + tree, hashlib.sha256((d / "config.json").read_bytes()).hexdigest()]


def _compile(model: Path, out: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch, target: str) -> dict:
    import portlayer

    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        m.setenv("PORTLAYER_CACHE", str(out.parent / f"cache-{out.name}"))
        art = portlayer.compile(model, target=target, output=out, progress=False).path
    return json.loads((art / "manifest.json").read_text())


@pytest.mark.parametrize("target", ["cpu-x86_64", "nvidia-h200"])
def test_concurrent_reference_gives_the_serial_artifact(tiny_dirs, tmp_path, monkeypatch, target):
    """Reference beside codegen + write vs before them: every file's bytes equal, manifests equal but timings."""
    from portlayer.build import SERIAL_REFERENCE_ENV

    model = tiny_dirs["tiny-llama"]
    serial = _compile(model, tmp_path / "serial", {SERIAL_REFERENCE_ENV: "1"}, monkeypatch, target)
    overlap = _compile(model, tmp_path / "overlap", {SERIAL_REFERENCE_ENV: "0"}, monkeypatch, target)
    assert "reference_wait" in overlap["timings_s"] and "reference_wait" not in serial["timings_s"]
    a = load_file(str(tmp_path / "serial" / "validation.safetensors"))
    b = load_file(str(tmp_path / "overlap" / "validation.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for m in (serial, overlap):
        for k in ("timings_s", "created_unix"):
            m.pop(k)
        m.get("binaries", {}).pop("compile_s", None)
        for h in m["stages"]["history"]:
            h["summary"].pop("seconds", None)  # each pass's own timing
    assert serial == overlap  # includes every file's sha256 (weights, graph, sources, validation set)


def test_lockstep_reference_is_the_per_step_reference_bit_for_bit(captured):
    """compute_reference runs every step node by node side by side (one float32 cast per weight);
    each output equals run_case on the per-step reference interpreter, for every tiny architecture
    and for bf16 weights (a lazy cast on a lazy cast)."""
    from portlayer.runtime import validation as V

    graphs = dict(captured)
    g = captured["tiny-llama"].copy()
    g.weights = WS.cast_view(g.weights, torch.bfloat16)
    graphs["tiny-llama-bf16"] = g
    for name, graph in graphs.items():
        got = V.compute_reference(graph, 16, seed=3)
        want = V.build_cases(graph, seed=3)
        ref = V._Reference(graph)
        assert [c.name for c in got] == [c.name for c in want]
        for gc, wc in zip(got, want):
            outs = V.run_case(ref, graph, wc, 16)
            assert len(gc.steps) == len(outs)
            for i, (s, o) in enumerate(zip(gc.steps, outs)):
                assert len(s.outputs) == len(o) > 0, (name, gc.name, i)
                for a, b in zip(s.outputs, o):
                    assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), (name, gc.name, i)


def test_a_cold_model_hash_runs_beside_the_capture_and_gives_the_serial_compiles_artifact(tiny_dirs, tmp_path,
                                                                                         monkeypatch):
    """Nothing memoised: the digest runs while the model is captured (the digest waits for the capture to
    start, so a serial order would time out), and the artifact is the one the serial order makes (every
    file's sha256 and the cache key). A copy of the model at a new path (memo misses) is still a cache hit."""
    import shutil
    import threading

    import portlayer
    from portlayer import flatten, model_source
    from portlayer.runtime.artifact import read_manifest

    d = tiny_dirs["tiny-qwen3"]
    started = threading.Event()
    seen: list[bool] = []  # per digest computed in the helper thread: whether the capture had started
    real_hash, real_capture = cache.model_dir_hash, flatten.capture

    def hash_after_capture_starts(path: Path) -> str:
        if threading.current_thread().name == "portlayer-model-hash":
            seen.append(started.wait(60))
        return real_hash(path)

    def capture(*a, **k):
        started.set()
        return real_capture(*a, **k)

    monkeypatch.setenv("PORTLAYER_CACHE", str(tmp_path / "serial"))
    serial = portlayer.compile(str(d), target="cpu-x86_64", progress=False)  # small model: digest, then capture
    monkeypatch.setenv("PORTLAYER_CACHE", str(tmp_path / "overlap"))
    monkeypatch.setattr(model_source, "OVERLAP_MIN_BYTES", 0)
    monkeypatch.setattr(cache, "model_dir_hash", hash_after_capture_starts)
    monkeypatch.setattr(flatten, "capture", capture)
    over = portlayer.compile(str(d), target="cpu-x86_64", progress=False)
    assert seen == [True] and not over.cache_hit and "source_wait" in over.timings
    a, b = read_manifest(serial.path), read_manifest(over.path)
    assert a.raw["cache_key"] == b.raw["cache_key"] and a.model["sha256"] == b.model["sha256"]
    assert {k: v["sha256"] for k, v in a.files.items()} == {k: v["sha256"] for k, v in b.files.items()}
    again = portlayer.compile(str(d), target="cpu-x86_64", progress=False)  # memoised now: looked up first
    assert again.cache_hit and len(seen) == 1 and "capture" not in again.timings
    copy = shutil.copytree(d, tmp_path / "copy")  # new inodes: the digest runs beside a capture again
    started.clear()
    hit = portlayer.compile(str(copy), target="cpu-x86_64", progress=False)
    assert hit.cache_hit and seen == [True, True] and hit.path == over.path


def test_a_failed_capture_beside_the_digest_raises_without_waiting_for_it(tiny_dirs, tmp_path, monkeypatch):
    import threading
    import time

    import portlayer
    from portlayer import flatten, model_source
    from portlayer.errors import PortlayerError

    release = threading.Event()
    real_hash = cache.model_dir_hash

    def slow_hash(path: Path) -> str:
        release.wait(60)
        return real_hash(path)

    class Refused(PortlayerError):
        pass

    def refuse(*_a, **_k):
        raise Refused("this model cannot be captured")

    monkeypatch.setenv("PORTLAYER_CACHE", str(tmp_path / "c"))
    monkeypatch.setattr(model_source, "OVERLAP_MIN_BYTES", 0)
    monkeypatch.setattr(cache, "model_dir_hash", slow_hash)
    monkeypatch.setattr(flatten, "capture", refuse)
    t0 = time.perf_counter()
    with pytest.raises(Refused):
        portlayer.compile(str(tiny_dirs["tiny-llama"]), target="cpu-x86_64", progress=False)
    release.set()
    assert time.perf_counter() - t0 < 30


def test_forged_chunk_fields_never_pass_a_modified_file(tmp_path, small_chunks):
    """Manifest entries are untrusted. A chunk size so large the float count underflowed to 0 chunks, a chunk list
    of the modified bytes beside the original plain sha256, a tiny chunk size (a memory blow-up), malformed
    digests: each is refused (False) or sent to the whole-file check (None), never accepted."""
    orig = os.urandom(5 * small_chunks + 7)
    path = tmp_path / "w.bin"
    path.write_bytes(orig[:-1] + bytes([orig[-1] ^ 1]))  # modified after the "manifest" below was made
    real = hashlib.sha256(orig).hexdigest()
    tree = _tree(orig, small_chunks)
    bad = path.read_bytes()
    assert file_hash.chunks_match(path, {"sha256": real, "chunk_bytes": 1 << 1100, "chunks_sha256": []}) is None
    assert file_hash.chunks_match(path, {"sha256": tree, "chunk_bytes": 1 << 1100, "chunks_sha256": []}) is False
    assert file_hash.chunks_match(path, {"sha256": real, "chunk_bytes": small_chunks,
                                         "chunks_sha256": _chunk_shas(bad, small_chunks)}) is None  # whole-file check
    for cb, chunks in ((1, _chunk_shas(bad, 1)[:3]), (small_chunks, ["x" * 64] * 6), (small_chunks, [])):
        assert file_hash.chunks_match(path, {"sha256": tree, "chunk_bytes": cb, "chunks_sha256": chunks}) is False
    assert file_hash.bytes_match(bad, {"sha256": _tree(bad, 1), "chunk_bytes": 1}) is False  # no 1-byte chunks
    assert file_hash.bytes_match(bad, {"sha256": _tree(bad, small_chunks), "chunk_bytes": small_chunks,
                                       "chunks_sha256": _chunk_shas(bad, small_chunks)}) is True
    assert file_hash.bytes_match(bad, {"sha256": tree, "chunk_bytes": small_chunks,
                                       "chunks_sha256": _chunk_shas(orig, small_chunks)}) is False


def test_range_hashes_are_hashlibs_over_the_bytes_there_at_edges(tmp_path, monkeypatch):
    """Memory-mapped windows: a range across window edges, past the end of the file, and an empty file."""
    monkeypatch.setattr(file_hash, "_BLOCK", 4096)
    data = os.urandom(3 * 4096 + 123)
    p = tmp_path / "w.bin"
    p.write_bytes(data)
    for start, size in [(0, len(data)), (4000, 5000), (4096, 4096), (len(data) - 5, 100), (len(data), 10), (7, 0)]:
        assert file_hash._hash_range(p, start, size) == hashlib.sha256(data[start:start + size]).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert file_hash._hash_range(tmp_path / "empty", 0, 10) == hashlib.sha256(b"").hexdigest()


def test_weights_written_beside_codegen_stop_when_codegen_fails(tiny_dirs, tmp_path, monkeypatch):
    """The weights file is written while codegen runs; a codegen that fails cancels that write (the writer
    thread is gone when the error arrives) and leaves no artifact or staging directory behind."""
    import threading

    import portlayer
    from portlayer import build
    from portlayer.errors import PortlayerError

    class Boom(PortlayerError):
        pass

    def failing_codegen(result, out_dir):
        raise Boom("the backend cannot generate this model")

    monkeypatch.setenv("PORTLAYER_CACHE", str(tmp_path / "c"))
    monkeypatch.setattr(build, "codegen", failing_codegen)
    out = tmp_path / "art"
    with pytest.raises(Boom):
        portlayer.compile(str(tiny_dirs["tiny-llama"]), target="cpu-x86_64", output=str(out), progress=False)
    assert not any(t.name == "portlayer-weights-write" and t.is_alive() for t in threading.enumerate())
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".art")]


def test_a_capture_failing_after_the_digest_saw_a_changed_file_reports_the_change(tiny_dirs, tmp_path, monkeypatch):
    """The digest beside the capture found a file that changed while it was read; the capture then trips over the
    same half-written file: the user sees the digest's "changed while it was being hashed", not the capture's error."""
    import threading

    import portlayer
    from portlayer import flatten, model_source

    failed = threading.Event()

    def changed(path: Path) -> str:
        failed.set()
        raise cache.ModelChangedError(f"{path}: changed while it was being hashed; compile again once it is complete")

    def broken_capture(*_a, **_k):
        failed.wait(30)
        raise RuntimeError("safetensors: header truncated")

    monkeypatch.setenv("PORTLAYER_CACHE", str(tmp_path / "c"))
    monkeypatch.setattr(model_source, "OVERLAP_MIN_BYTES", 0)
    monkeypatch.setattr(cache, "model_dir_hash", changed)
    monkeypatch.setattr(flatten, "capture", broken_capture)
    with pytest.raises(cache.ModelChangedError, match="changed while it was being hashed"):
        portlayer.compile(str(tiny_dirs["tiny-llama"]), target="cpu-x86_64", progress=False)


@pytest.mark.parametrize("threads", ["1", "3"])
def test_hash_thread_count_from_the_environment_gives_hashlibs_digests(tmp_path, small_chunks, monkeypatch, threads):
    """$PORTLAYER_HASH_THREADS sets the hashing pool (the load's background check uses it); any count gives the
    chunk digests hashlib computes over the file's bytes, and a damaged file still fails."""
    data = os.urandom(5 * small_chunks + 77)
    path = tmp_path / "w.bin"
    path.write_bytes(data)
    monkeypatch.setenv("PORTLAYER_HASH_THREADS", threads)
    assert file_hash._threads() == int(threads)
    got = file_hash.hashes(path)
    assert got["chunks_sha256"] == _chunk_shas(data, small_chunks)
    assert file_hash.chunks_match(path, got) is True
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert file_hash.chunks_match(path, got) is False


def test_a_bad_hash_thread_count_names_the_variable(monkeypatch):
    monkeypatch.setenv("PORTLAYER_HASH_THREADS", "many")
    with pytest.raises(ValueError, match="PORTLAYER_HASH_THREADS='many'"):
        file_hash._threads()
