"""Weights flow tensor by tensor (issue 20): lazy casts, the streaming safetensors writer, mmap loading.

Every expected value comes from outside the code under test: safetensors' own reader, torch's
dtype conversion, HF ``generate`` on the same checkpoint, the kernel's /proc/self/maps.
"""

from __future__ import annotations

import os
import threading
import weakref

import pytest
import torch
from safetensors.torch import load_file

from portlayer.flatten.weights_stream import Lazy, WeightStore, cast, raw, write_tensors


def test_write_tensors_reads_back_with_safetensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 17, generator=g)
    tensors = {
        "f32": x, "bf16_lazy": cast(x, torch.bfloat16), "f16": x.half(), "i64": torch.arange(11),
        "i8": torch.randint(-128, 127, (5, 3), dtype=torch.int8, generator=g), "empty": torch.zeros(0, 4),
        "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5), "view": x[:, 3],  # non-contiguous
    }  # fmt: skip
    n = write_tensors(tmp_path / "w.safetensors", tensors.items(), metadata={"format": "pt"}, threads=3)
    assert n == os.path.getsize(tmp_path / "w.safetensors")
    back = load_file(str(tmp_path / "w.safetensors"))
    assert list(back) == sorted(tensors) or set(back) == set(tensors)
    for name, v in tensors.items():
        want = v() if isinstance(v, Lazy) else v
        assert back[name].dtype == want.dtype and back[name].shape == want.shape, name
        assert torch.equal(back[name], want), name
    assert torch.equal(back["bf16_lazy"], x.to(torch.bfloat16))


def test_writer_makes_each_lazy_weight_once_with_a_bounded_working_set(tmp_path):
    made: dict[str, int] = {}
    alive, peak, lock = [0], [0], threading.Lock()

    def maker(name: str, seed: int):
        def make() -> torch.Tensor:
            t = torch.full((256, 1024), float(seed))  # 1 MiB each
            with lock:
                made[name] = made.get(name, 0) + 1
                alive[0] += 1
                peak[0] = max(peak[0], alive[0])
            weakref.finalize(t, lambda: _dec(alive, lock))
            return t
        return make

    entries = [(f"w{i}", Lazy(torch.float32, (256, 1024), maker(f"w{i}", i))) for i in range(48)]
    write_tensors(tmp_path / "w.safetensors", entries, threads=2)
    assert made == {f"w{i}": 1 for i in range(48)}
    assert peak[0] <= 2 * 2 + 2, f"{peak[0]} tensors alive at once (of 48)"
    back = load_file(str(tmp_path / "w.safetensors"))
    assert all(float(back[f"w{i}"][0, 0]) == i for i in range(48))


def _dec(alive, lock):
    with lock:
        alive[0] -= 1


def test_weight_store_copy_stays_lazy_and_reads_convert():
    calls = []
    base = torch.randn(4, 4)
    store = WeightStore({"a": base})
    store["b"] = Lazy(torch.float16, (4, 4), lambda: calls.append(1) or base.half())
    c = store.copy()
    assert isinstance(raw(c, "b"), Lazy) and not calls
    assert torch.equal(c["b"], base.half()) and len(calls) == 1
    assert c["a"] is base


def test_precision_pass_casts_lazily(tiny_dirs):
    """bf16 compute on an fp32 capture: the graph's weights are Lazy casts, equal to torch's .to()."""
    from portlayer.flatten import capture
    from portlayer.passes.pipeline import run_pipeline

    graph = capture(tiny_dirs["tiny-llama"], verify=False)
    res = run_pipeline(graph, "cpu-x86_64", overrides={"compute_dtype": "bfloat16"})
    w = res.graph.weights
    lazy = [n for n in w if isinstance(raw(w, n), Lazy)]
    assert lazy, "no weight was cast lazily"
    for name in lazy[:5]:
        src = name if name in graph.weights else None
        assert w[name].dtype == torch.bfloat16
        if src:
            assert torch.equal(w[name], graph.weights[src].to(torch.bfloat16))


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    """A tiny Llama saved in bf16 (as big checkpoints ship), and the artifact compiled for the CPU (fp32 compute)."""
    from artifact_samples import save_tiny_llama

    import portlayer

    d = save_tiny_llama(tmp_path_factory.mktemp("bf16-llama") / "model", hidden=64, intermediate=128, max_positions=256,
                        dtype=torch.bfloat16)
    art = portlayer.compile(d, target="cpu-x86_64", output=d.parent / "art", progress=False)
    return d, art.path


def test_bf16_checkpoint_artifact_matches_hf_generate(bf16_llama):
    from transformers import LlamaForCausalLM

    import portlayer

    d, art = bf16_llama
    hf = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    prompt = torch.randint(3, 256, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
    m = portlayer.load(art)
    assert m.validate().ok
    assert m.generate(prompt, max_tokens=8).token_ids == want


def test_artifact_weights_are_memory_mapped_and_checked(bf16_llama, monkeypatch):
    import portlayer
    from portlayer.runtime import artifact as A

    _, art = bf16_llama
    monkeypatch.setattr(A, "HOLD_MAX_BYTES", 0)  # treat every file as big: weights go the mmap path
    m = portlayer.load(art)
    weights = m.graph.weights
    wfile = str((art / A.WEIGHTS).resolve())
    with open("/proc/self/maps") as f:
        assert wfile in f.read(), "weights.safetensors is not memory-mapped"
    on_disk = load_file(wfile)
    for name in list(weights)[:8]:
        stored = name if name in on_disk else None
        if stored:
            assert torch.equal(weights[name], on_disk[stored])
    m2 = portlayer.load(art)
    st = os.stat(wfile)
    os.utime(wfile, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # changed after verification
    try:
        with pytest.raises(A.ArtifactError, match="changed since the artifact was verified"):
            m2.graph  # noqa: B018
    finally:
        os.utime(wfile, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_big_files_are_verified_by_parallel_chunk_hashes(bf16_llama, tmp_path, monkeypatch):
    """Per-chunk sha256 in the manifest (hashlib's own digest of each range); one flipped byte is refused."""
    import hashlib
    import json
    import shutil

    import portlayer
    from portlayer.runtime import artifact as A
    from portlayer.runtime import file_hash

    d, _ = bf16_llama
    monkeypatch.setattr(file_hash, "CHUNKED_MIN_BYTES", 1 << 10)
    monkeypatch.setattr(file_hash, "CHUNK_BYTES", 1 << 14)
    art = portlayer.compile(d, target="cpu-x86_64", output=tmp_path / "art", progress=False).path
    info = json.loads((art / A.MANIFEST).read_text())["files"][A.WEIGHTS]
    data = (art / A.WEIGHTS).read_bytes()
    cb = info["chunk_bytes"]
    assert info["chunks_sha256"] == [hashlib.sha256(data[i:i + cb]).hexdigest() for i in range(0, len(data), cb)]
    assert info["sha256"] == "chunks:" + hashlib.sha256(f"{cb}:".encode() + "".join(info["chunks_sha256"]).encode()).hexdigest()
    assert portlayer.load(art).validate().ok
    bad = tmp_path / "bad"
    shutil.copytree(art, bad)
    with open(bad / A.WEIGHTS, "r+b") as f:
        f.seek(len(data) // 2)
        byte = f.read(1)
        f.seek(len(data) // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(A.ArtifactError, match="weights.safetensors .*sha256 differs"):
        portlayer.load(bad)


def test_big_captures_are_not_copied_into_the_capture_cache(tiny_dirs, monkeypatch):
    from portlayer.build import CAPTURE_CACHE_MAX_ENV, capture_cached
    from portlayer.runtime.cache import cache_root, model_dir_hash

    d = tiny_dirs["tiny-llama"]
    monkeypatch.setenv(CAPTURE_CACHE_MAX_ENV, "0")
    before = set((cache_root() / "captured").glob("*")) if (cache_root() / "captured").exists() else set()
    said: list[str] = []
    graph = capture_cached(d, model_dir_hash(d) + "-uncached", said.append, verify=False)
    assert graph.weights and any("capture not cached" in m for m in said)
    after = set((cache_root() / "captured").glob("*")) if (cache_root() / "captured").exists() else set()
    assert after == before
