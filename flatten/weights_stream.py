"""Weights that are computed when read, and a safetensors writer that takes them one at a time.

A big model must not exist twice in host memory. Passes that only change how a weight is
stored (the precision pass's dtype cast, for one) record the change as a ``Lazy`` entry of a
``WeightStore`` instead of converting every tensor at once; the tensor is made when someone
reads it (the writer, the interpreter one node at a time, a program copying it to a device)
and dropped after. ``write_tensors`` writes safetensors from an iterator of entries, so an
artifact's weights go to disk tensor by tensor with a bounded working set; tensor-parallel
shard writers call it with their own per-rank entries.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from portlayer.flatten.ir import dtype_name

#: safetensors' dtype codes (https://github.com/huggingface/safetensors, format: header JSON "dtype")
ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


@dataclass(frozen=True)
class Lazy:
    """A weight of known dtype and shape, made by ``make()`` each time it is read (never cached)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]

    def __call__(self) -> torch.Tensor:
        t = self.make()
        if t.dtype != self.dtype or tuple(t.shape) != self.shape:
            raise ValueError(f"lazy weight made {t.dtype}{list(t.shape)}, declared {self.dtype}{list(self.shape)}")
        return t


def cast(value: torch.Tensor | Lazy, dtype: torch.dtype) -> torch.Tensor | Lazy:
    """``value`` as ``dtype`` when read: no conversion now, none kept."""
    if value.dtype == dtype:
        return value
    if isinstance(value, Lazy):
        return Lazy(dtype, value.shape, lambda: value().to(dtype))
    src = value.detach()
    return Lazy(dtype, tuple(src.shape), lambda: src.to(dtype))


class WeightStore(MutableMapping[str, torch.Tensor]):
    """name -> tensor, where an entry may be Lazy: reading it makes the tensor (``raw`` does not)."""

    def __init__(self, items: Mapping[str, Any] | None = None) -> None:
        self._d: dict[str, torch.Tensor | Lazy] = {}
        if isinstance(items, WeightStore):
            self._d.update(items._d)
        elif items:
            self._d.update(items)

    def __getitem__(self, name: str) -> torch.Tensor:
        v = self._d[name]
        return v() if isinstance(v, Lazy) else v

    def __setitem__(self, name: str, value: torch.Tensor | Lazy) -> None:
        self._d[name] = value

    def __delitem__(self, name: str) -> None:
        del self._d[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, name: object) -> bool:
        return name in self._d

    def raw(self, name: str) -> torch.Tensor | Lazy:
        return self._d[name]

    def copy(self) -> WeightStore:
        return WeightStore(self)

    def __repr__(self) -> str:
        lazy = sum(isinstance(v, Lazy) for v in self._d.values())
        return f"<WeightStore {len(self)} weights, {lazy} lazy>"


def raw(weights: Mapping[str, Any], name: str) -> torch.Tensor | Lazy:
    """The entry without making it (a plain dict holds tensors only)."""
    return weights.raw(name) if isinstance(weights, WeightStore) else weights[name]


def spec(weights: Mapping[str, Any], name: str) -> tuple[str, tuple[int, ...]]:
    """(dtype name, shape) of a weight without reading it."""
    v = raw(weights, name)
    return dtype_name(v.dtype), tuple(v.shape)


def store_of(weights: Mapping[str, Any]) -> WeightStore:
    return weights if isinstance(weights, WeightStore) else WeightStore(weights)


def cast_view(weights: Mapping[str, Any], dtype: torch.dtype) -> WeightStore:
    """Every floating weight as ``dtype`` when read (the reference runs in float32 this way)."""
    out = WeightStore()
    for name in weights:
        v = raw(weights, name)
        out[name] = cast(v, dtype) if v.dtype.is_floating_point else v
    return out


# ---- writing ------------------------------------------------------------------------------
Entry = tuple[str, "torch.Tensor | Lazy"]


def _header(entries: list[Entry], metadata: Mapping[str, str] | None) -> tuple[bytes, list[int]]:
    head: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset, sizes = 0, []
    for name, v in entries:
        if v.dtype not in ST_DTYPES:
            raise ValueError(f"weight {name!r}: dtype {v.dtype} cannot be stored in safetensors")
        n = int(torch.Size(v.shape).numel()) * torch.empty((), dtype=v.dtype).element_size()
        head[name] = {"dtype": ST_DTYPES[v.dtype], "shape": list(v.shape), "data_offsets": [offset, offset + n]}
        sizes.append(n)
        offset += n
    raw_head = json.dumps(head, separators=(",", ":")).encode()
    raw_head += b" " * (-len(raw_head) % 8)  # the format aligns the data to 8 bytes
    return struct.pack("<Q", len(raw_head)) + raw_head, sizes


def _bytes_of(name: str, v: torch.Tensor | Lazy, size: int) -> memoryview:
    t = v() if isinstance(v, Lazy) else v
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    data = t.reshape(-1).view(torch.uint8).numpy().data
    if data.nbytes != size:
        raise ValueError(f"weight {name!r}: {data.nbytes} bytes, its header says {size}")
    return data


#: bytes of tensors made ahead of the writer (at least one tensor is always in flight)
IN_FLIGHT_BYTES = 512 << 20
#: the chunk size of the per-chunk sha256 computed while writing (runtime/file_hash.py's CHUNK_BYTES)
HASH_CHUNK_BYTES = 64 << 20
#: files this big or bigger get no whole-file sha256, only chunk hashes (runtime/file_hash.py's CHUNKED_MIN_BYTES:
#: their manifest digest is the chunk list's, "chunks:...")
WHOLE_HASH_MAX_BYTES = 256 << 20
#: files written by write_tensors: (st_dev, st_ino, st_size, st_mtime_ns) -> their sha256s (written_hashes)
_WRITTEN: dict[tuple[int, int, int, int], dict[str, Any]] = {}
_WRITTEN_MAX = 256
_WRITTEN_LOCK = threading.Lock()  # writers run in helper threads (serialize.WeightsWrite)


def write_tensors(path: str | os.PathLike[str], entries: Iterable[Entry], metadata: Mapping[str, str] | None = None,
                  threads: int | None = None, on_tensor: Callable[[str], None] | None = None,
                  in_flight_bytes: int = IN_FLIGHT_BYTES) -> int:
    """Write a safetensors file from ``(name, tensor or Lazy)`` entries, one tensor at a time.

    Only the entries' dtypes and shapes are needed for the header, so every tensor's offset is
    known up front: a pool of ``threads`` workers makes each tensor (Lazy entries are computed
    there) and writes it at its offset (``os.pwrite``: several tensors at once), ahead of the
    oldest unfinished one by at most ``in_flight_bytes`` and 2 tensors per thread, so the working
    set is bounded whatever the model's size. The per-chunk sha256s (and a small file's whole sha256)
    are computed from those same bytes as they are written (``_StreamHashes``: chunks in parallel),
    so the artifact's manifest never reads the file again (``written_hashes``). Returns the file's size in bytes.
    The file is read back by ``safetensors.safe_open`` like any other.
    """
    from collections import deque

    items = list(entries)
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ValueError(f"write_tensors: duplicate names {sorted({n for n in names if names.count(n) > 1})[:5]}")
    head, sizes = _header(items, metadata)
    offsets, at = [], len(head)
    for n in sizes:
        offsets.append(at)
        at += n
    workers = max(1, threads if threads is not None else min(8, os.cpu_count() or 1))
    hasher = _StreamHashes(HASH_CHUNK_BYTES, whole=at < WHOLE_HASH_MAX_BYTES, workers=workers)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with ThreadPoolExecutor(workers) as pool:
            _pwrite(fd, memoryview(head), 0)
            hashing = deque([(0, hasher.feed(memoryview(head)))])  # (bytes, futures) in file order
            pending: deque[tuple[str, int, Any]] = deque()  # (name, bytes, future), in file order
            held = 0

            def hand_over() -> None:  # the oldest written tensor goes to the hashers, in file order
                name, n, fut = pending.popleft()
                hashing.append((n, hasher.feed(fut.result())))
                if on_tensor is not None:
                    on_tensor(name)

            def retire() -> int:
                n, futs = hashing.popleft()
                for f in futs:
                    f.result()
                return n

            for k, (name, v) in enumerate(items):
                while len(pending) >= 2 * workers:
                    hand_over()
                while len(hashing) > 2 * workers or (held + sizes[k] > in_flight_bytes and (pending or hashing)):
                    if hashing:
                        held -= retire()
                    else:
                        hand_over()
                pending.append((name, sizes[k], pool.submit(_write_one, fd, name, v, sizes[k], offsets[k])))
                held += sizes[k]
            while pending:
                hand_over()
            while hashing:
                retire()
    finally:
        os.close(fd)
        hasher.close()
    st = os.stat(path)
    if st.st_size == at:
        with _WRITTEN_LOCK:
            if len(_WRITTEN) >= _WRITTEN_MAX:
                _WRITTEN.pop(next(iter(_WRITTEN)))
            _WRITTEN[_stat_key(st)] = hasher.result()
    return at


def written_hashes(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """{"chunk_bytes", "chunks_sha256"} (and "sha256" for a file under WHOLE_HASH_MAX_BYTES) of a file this
    process wrote with write_tensors, if it is still that file (same device, inode, size and modification
    time); else None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    with _WRITTEN_LOCK:
        got = _WRITTEN.get(_stat_key(st))
    return None if got is None else {**got, "chunks_sha256": list(got["chunks_sha256"])}


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _write_one(fd: int, name: str, v: torch.Tensor | Lazy, size: int, offset: int) -> memoryview:
    data = _bytes_of(name, v, size)
    _pwrite(fd, data, offset)
    return data


class _StreamHashes:
    """The sha256 of each ``chunk_bytes`` piece of a byte stream fed in order, and of the whole stream when
    ``whole`` (small files). Chunk c is hashed on worker c mod n, each worker a single thread running its
    jobs in order, so one chunk's pieces are hashed in order while neighbouring chunks hash side by side
    (hashlib releases the GIL): ~1.2 GB/s per thread on the H200 host, so one serial pass over an 8B
    model's 16 GB was 13 s of its compile, and ~10 GB/s across the workers."""

    def __init__(self, chunk_bytes: int, whole: bool = True, workers: int = 8) -> None:
        import hashlib

        self._sha = hashlib.sha256
        self.chunk_bytes = chunk_bytes
        self.whole = hashlib.sha256() if whole else None
        self.parts: list[Any] = []  # one hasher per chunk, in file order
        self.fed = 0
        self._pools = [ThreadPoolExecutor(1) for _ in range(max(1, workers) + (1 if whole else 0))]

    def feed(self, data: memoryview) -> list[Any]:
        """Queue ``data`` (the next bytes of the stream); futures that finish when it is hashed."""
        futs, i = [], 0
        if self.whole is not None:
            futs.append(self._pools[-1].submit(self.whole.update, data))
        n = len(self._pools) - (1 if self.whole is not None else 0)
        while i < len(data):
            c = self.fed // self.chunk_bytes
            take = min(len(data) - i, (c + 1) * self.chunk_bytes - self.fed)
            if c == len(self.parts):
                self.parts.append(self._sha())
            futs.append(self._pools[c % n].submit(self.parts[c].update, data[i:i + take]))
            self.fed += take
            i += take
        return futs

    def close(self) -> None:
        for p in self._pools:
            p.shutdown(wait=True)

    def result(self) -> dict[str, Any]:
        """{"chunk_bytes", "chunks_sha256"} and, when hashed whole, "sha256" (call after close)."""
        out: dict[str, Any] = {"chunk_bytes": self.chunk_bytes, "chunks_sha256": [h.hexdigest() for h in self.parts]}
        if self.whole is not None:
            out["sha256"] = self.whole.hexdigest()
        return out


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def stream_entries(weights: Mapping[str, Any]) -> tuple[list[Entry], dict[str, str]]:
    """(entries to write, {alias: stored name}) without reading any lazy weight.

    safetensors stores each tensor once: a tensor that is the very same view as an earlier
    one (tied embeddings) becomes an alias of it; anything else is written as its own bytes
    (a partial view of a shared storage is copied one tensor at a time, while it is written).
    """
    entries: list[Entry] = []
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name in weights:
        v = raw(weights, name)
        if isinstance(v, torch.Tensor) and v.numel():
            key = _view_key(v)
            if key in seen:
                aliases[name] = seen[key]
                continue
            seen[key] = name
        entries.append((name, v))
    return entries, aliases


def open_safetensors(path: str | os.PathLike[str]) -> WeightStore:
    """Every tensor of a safetensors file, memory-mapped by safetensors.safe_open: nothing is read
    until a tensor's bytes are used (copied to a device, or read by the CPU program in place)."""
    from safetensors import safe_open

    store = WeightStore()
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
            store[name] = f.get_tensor(name)
    return store
