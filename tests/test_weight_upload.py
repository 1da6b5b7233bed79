"""codegen/weight_upload.py: the staged copy gives the plain ``.to``'s tensors bit for bit.

The staging mechanics (pieces, buffer reuse, tails, small tensors, a dtype change) run here on the
CPU through a stand-in device module (streams and events that complete at once, an unpinned buffer);
the reference is torch's own ``Tensor.to``."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from portlayer.codegen import weight_upload


class _Event:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Stream:
    def synchronize(self) -> None:
        pass


@pytest.fixture
def staged(monkeypatch):
    shim = SimpleNamespace(Stream=_Stream, Event=_Event, stream=lambda s: contextlib.nullcontext(),
                           device=lambda d: contextlib.nullcontext())
    monkeypatch.setattr(weight_upload, "_device_module", lambda device: shim)
    monkeypatch.setattr(weight_upload, "_pinned", lambda n: torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(weight_upload, "STAGE_BYTES", 4096)  # several pieces per tensor, buffers reused
    monkeypatch.setattr(weight_upload, "SMALL_BYTES", 1024)
    calls = []
    real = weight_upload.ThreadPoolExecutor

    def pool(n, **kw):
        calls.append(n)
        return real(n, **kw)

    monkeypatch.setattr(weight_upload, "ThreadPoolExecutor", pool)
    return calls


def test_staged_copy_equals_plain_to(staged):
    g = torch.Generator().manual_seed(0)
    weights = {
        "w_bf16": torch.randn(37, 129, generator=g).to(torch.bfloat16),  # 9546 B: pieces of 4096 + a tail
        "w_f32": torch.randn(4096, generator=g),  # exactly 4 pieces
        "w_i8": torch.randint(-128, 127, (5000,), dtype=torch.int8, generator=g),
        "small": torch.randn(7, generator=g),  # below SMALL_BYTES: the plain path
        "scalar": torch.tensor(3.5),
        "to_half": torch.randn(64, 64, generator=g),  # converted after the byte copy
    }
    dtypes = {k: v.dtype for k, v in weights.items()} | {"to_half": torch.float16}
    out = weight_upload.upload(weights, dtypes, "cpu", threads=3)
    assert staged == [3], "the staged path ran with the threads asked for"
    assert set(out) == set(dtypes)
    for k, v in weights.items():
        ref = v.to(dtype=dtypes[k])
        assert out[k].dtype == ref.dtype and out[k].shape == ref.shape
        assert torch.equal(out[k].reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), k
        if v.nbytes >= weight_upload.SMALL_BYTES:
            assert out[k].data_ptr() != v.data_ptr(), f"{k} was copied, not aliased"


def test_only_the_named_weights_are_uploaded(staged):
    weights = {"a": torch.arange(2048, dtype=torch.float32), "unused": torch.zeros(4096)}
    out = weight_upload.upload(weights, {"a": torch.float32}, "cpu", threads=2)
    assert list(out) == ["a"] and torch.equal(out["a"], weights["a"])


def test_plain_path_on_the_cpu_and_bad_thread_count(monkeypatch):
    w = {"a": torch.randn(1024, 512)}
    out = weight_upload.upload(w, {"a": torch.float32}, "cpu")
    assert torch.equal(out["a"], w["a"])
    monkeypatch.setenv("PORTLAYER_UPLOAD_THREADS", "many")
    monkeypatch.setattr(weight_upload, "_device_module", lambda d: object())
    with pytest.raises(ValueError, match="PORTLAYER_UPLOAD_THREADS"):
        weight_upload.upload(w, {"a": torch.float32}, "cpu")
