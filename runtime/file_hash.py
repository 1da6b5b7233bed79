"""sha256 of big artifact files in parallel: per-chunk hashes, checked by several threads at once.

A file's single sha256 is one serial pass (~1.5 GB/s): 10 s for an 8B model's weights, longer
than the load it guards. The manifest therefore also records the sha256 of each fixed-size
chunk of a big file; verification checks the chunks in parallel threads (hashlib releases the
GIL), so it runs at disk or page-cache speed. A big file's manifest digest is therefore the chunk
list's (``chunk_tree``: "chunks:" + the sha256 of "67108864:" followed by the chunks' hex sha256s, in
order), never a serial whole-file pass; check one by hand with ``split -b 64M`` and ``sha256sum``.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from portlayer.config import positive_int_env

#: files at least this big get per-chunk hashes
CHUNKED_MIN_BYTES = 256 << 20
CHUNK_BYTES = 64 << 20
_BLOCK = 16 << 20  # one read and one hashlib.update (each releasing the GIL) per window


def _threads() -> int:
    """Hashing threads: $PORTLAYER_HASH_THREADS, else one per core up to 16."""
    return positive_int_env("PORTLAYER_HASH_THREADS", max(1, min(16, os.cpu_count() or 1)), "threads hashing big files")


def _hash_range(path: Path, start: int, size: int) -> str:
    """sha256 of ``size`` bytes at ``start``, read in _BLOCK windows into one reused buffer: hashlib and the
    read release the GIL for a whole window, so a busy Python thread beside the hash (the capture, the load)
    costs two GIL hand-overs per window; a fresh bytes object per small read (the old 8 MiB reads) also faulted
    in new memory every time. Plain reads, never a memory map: a file truncated meanwhile gives a short read
    (the caller's mismatch or ModelChangedError), not a bus error."""
    h = hashlib.sha256()
    if size <= 0:
        return h.hexdigest()
    buf = bytearray(min(_BLOCK, size))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = size
        while left > 0:
            n = f.readinto(view[:min(_BLOCK, left)])
            if not n:
                break
            h.update(view[:n])
            left -= n
    return h.hexdigest()


def _whole(path: Path) -> str:
    return _hash_range(path, 0, path.stat().st_size)


def chunk_tree(chunks: list[str]) -> str:
    """The digest a big file is known by: "chunks:" + the sha256 of the chunk size (CHUNK_BYTES, the only one
    accepted) and its chunks' sha256s. Any changed byte changes it, as it would the file's own sha256, and it
    is computed from hashes taken in parallel instead of one serial pass over the file."""
    return "chunks:" + hashlib.sha256(f"{CHUNK_BYTES}:".encode() + "".join(chunks).encode()).hexdigest()


_HEX = frozenset("0123456789abcdef")


def _chunk_list(info: Mapping[str, Any], size: int) -> list[str] | None:
    """The entry's chunk digests when they are well formed for a file of ``size`` bytes: chunk_bytes exactly
    CHUNK_BYTES (what the writer uses; an untrusted huge one made the count 0 and skipped every hash, a tiny one
    would exhaust memory), one 64-hex-digit sha256 per chunk, at least one chunk; else None."""
    cb, chunks = info.get("chunk_bytes"), info.get("chunks_sha256")
    if type(cb) is not int or cb != CHUNK_BYTES or not isinstance(chunks, list) or size <= 0:
        return None
    if len(chunks) != -(-size // cb) or not all(isinstance(c, str) and len(c) == 64 and set(c) <= _HEX for c in chunks):
        return None
    return chunks


def bytes_match(data: bytes, info: Mapping[str, Any]) -> bool:
    """Whether ``data`` (a file read whole) is what manifest entry ``info`` (untrusted) names: its sha256,
    or its chunk tree when the digest is one ("chunks:...", with well-formed chunk fields, see _chunk_list)."""
    digest = info.get("sha256")
    if not isinstance(digest, str):
        return False
    if not digest.startswith("chunks:"):
        return hashlib.sha256(data).hexdigest() == digest
    if _chunk_list(info, len(data)) is None:
        return False
    view, cb = memoryview(data), CHUNK_BYTES
    return chunk_tree([hashlib.sha256(view[i:i + cb]).hexdigest() for i in range(0, len(data), cb)]) == digest


def hashes(path: Path) -> dict[str, Any]:
    """{"sha256": the whole file's} for a file under CHUNKED_MIN_BYTES; for a bigger one {"sha256":
    chunk_tree(...), "chunk_bytes", "chunks_sha256"}, the chunks hashed in parallel threads.

    A file this process wrote with ``write_tensors`` (the artifact's weights) was hashed as it was
    written: those digests are used while the file is unchanged (inode, size, mtime), with no second read."""
    from portlayer.flatten.weights_stream import written_hashes

    size = path.stat().st_size
    known = written_hashes(path)
    if known is not None and known["chunk_bytes"] == CHUNK_BYTES:
        if size >= CHUNKED_MIN_BYTES:
            return {"sha256": chunk_tree(known["chunks_sha256"]), "chunk_bytes": CHUNK_BYTES,
                    "chunks_sha256": known["chunks_sha256"]}
        if "sha256" in known:
            return {"sha256": known["sha256"]}
    if size < CHUNKED_MIN_BYTES:
        return {"sha256": _whole(path)}
    starts = range(0, size, CHUNK_BYTES)
    with ThreadPoolExecutor(_threads()) as pool:
        chunks = list(pool.map(lambda s: _hash_range(path, s, min(CHUNK_BYTES, size - s)), starts))
    return {"sha256": chunk_tree(chunks), "chunk_bytes": CHUNK_BYTES, "chunks_sha256": chunks}


def content_digests(paths: list[Path]) -> list[str]:
    """A content digest per file, all files' chunks hashed by one pool of threads: the sha256 of a file
    under CHUNKED_MIN_BYTES, else "chunks:" + the sha256 of its CHUNK_BYTES chunks' sha256s (any changed
    byte changes it, as it changes the file's own sha256; computed in parallel instead of one serial pass)."""
    sizes = [p.stat().st_size for p in paths]
    jobs = [(i, s, min(CHUNK_BYTES, n - s)) for i, n in enumerate(sizes) if n >= CHUNKED_MIN_BYTES
            for s in range(0, n, CHUNK_BYTES)]
    with ThreadPoolExecutor(_threads()) as pool:
        small = {i: pool.submit(_whole, p) for i, (p, n) in enumerate(zip(paths, sizes)) if n < CHUNKED_MIN_BYTES}
        parts = list(pool.map(lambda j: _hash_range(paths[j[0]], j[1], j[2]), jobs))
    per: dict[int, list[str]] = {}
    for (i, _s, _n), h in zip(jobs, parts):
        per.setdefault(i, []).append(h)
    out = []
    for i in range(len(paths)):
        if i in small:
            out.append(small[i].result())
        else:
            out.append(chunk_tree(per[i]))
    return out


def chunks_match(path: Path, info: Mapping[str, Any]) -> bool | None:
    """Whether the file is what manifest entry ``info`` (untrusted) names, checked chunk by chunk in parallel:
    only for a chunk-tree digest ("chunks:..."), whose chunk list must be well formed (_chunk_list) and agree
    with the digest, else False. None for a plain sha256 digest: a chunk list beside it is not tied to it,
    so the caller checks the whole-file sha256."""
    check = ChunkCheck()
    try:
        queued = check.add(str(path), path, info)
        return queued if queued is not True else not check.wait()
    finally:
        check.cancel()


class ChunkCheck:
    """The per-chunk sha256 check of big files, hashed by a pool of threads while the caller goes on.

    ``add`` queues a file's chunks; ``seal`` says no more will come (the pool then shuts itself down
    when the last chunk is hashed); ``wait`` joins and returns {key: why} for each file that does not
    match; ``cancel`` drops what is not hashed yet. The pool is this object's: no module-level state."""

    def __init__(self, threads: int | None = None) -> None:
        self._pool = ThreadPoolExecutor(threads or _threads(), thread_name_prefix="portlayer-sha256")
        self._jobs: dict[str, tuple[list[str], list[Future[str]]]] = {}
        self._lock = threading.Lock()
        self._left = 0
        self._sealed = False
        self._result: dict[str, str] | None = None
        self.started = time.perf_counter()
        self.finished: float | None = None  # perf_counter when the last chunk was hashed
        self.bytes = 0

    def add(self, key: str, path: Path, info: Mapping[str, Any]) -> bool | None:
        """Queue ``path``'s chunks against manifest entry ``info`` (untrusted): True when queued; None for a
        plain sha256 digest (the caller checks the whole file); False when a chunk-tree digest's chunk list
        is malformed or disagrees with it (a mismatch, nothing to hash). The rules of ``chunks_match``."""
        digest = info.get("sha256")
        if not (isinstance(digest, str) and digest.startswith("chunks:")):
            return None
        size = path.stat().st_size
        chunks = _chunk_list(info, size)
        cb = CHUNK_BYTES
        if chunks is None or digest != chunk_tree(chunks):
            return False
        with self._lock:
            if self._sealed:
                raise RuntimeError("ChunkCheck.add after seal")
            self._left += len(chunks)
            self.bytes += size
        futures = [self._pool.submit(lambda s: _hash_range(path, s, min(cb, size - s)), i * cb)
                   for i in range(len(chunks))]
        self._jobs[key] = (list(chunks), futures)
        for f in futures:
            f.add_done_callback(self._one_done)
        return True

    @property
    def empty(self) -> bool:
        return not self._jobs

    def keys(self) -> list[str]:
        return list(self._jobs)

    def seal(self) -> None:
        """No more files: the pool shuts down once the queued chunks are hashed (or at ``wait``)."""
        with self._lock:
            self._sealed = True
            last = self._left == 0
        if last:
            self._finish()

    def _one_done(self, _f: Future[str]) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0 and self._sealed
        if last:
            self._finish()

    def _finish(self) -> None:
        if self.finished is None:
            self.finished = time.perf_counter()
        self._pool.shutdown(wait=False)

    def wait(self) -> dict[str, str]:
        """Join: {key: why} for every queued file whose chunks differ from its manifest entry (or could not
        be read); empty when all match. Computed once; the pool is shut down on return."""
        with self._lock:
            self._sealed = True
        if self._result is None:
            bad = {}
            for key, (want, futures) in self._jobs.items():
                try:
                    if [f.result() for f in futures] != want:
                        bad[key] = "sha256 differs from the manifest (modified)"
                except OSError as e:
                    bad[key] = f"could not be read while it was verified ({e})"
                except CancelledError:
                    bad[key] = "not verified (the check was cancelled)"
            self._result = bad
            self._finish()
            self._pool.shutdown(wait=True)
        return dict(self._result)

    def cancel(self) -> None:
        """Drop the chunks not hashed yet (a load that failed or was abandoned); the pool shuts down."""
        with self._lock:
            self._sealed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
