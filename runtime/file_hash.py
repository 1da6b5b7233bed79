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
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

#: files at least this big get per-chunk hashes
CHUNKED_MIN_BYTES = 256 << 20
CHUNK_BYTES = 64 << 20
_BLOCK = 8 << 20


def _threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def _hash_range(path: Path, start: int, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = size
        while left > 0:
            block = f.read(min(_BLOCK, left))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def _whole(path: Path) -> str:
    return _hash_range(path, 0, path.stat().st_size)


def chunk_tree(chunks: list[str], chunk_bytes: int | None = None) -> str:
    """The digest a big file is known by: "chunks:" + the sha256 of its chunk size and its chunks' sha256s.
    Any changed byte changes it, as it would the file's own sha256, and it is computed from hashes
    taken in parallel instead of one serial pass over the file."""
    cb = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    return "chunks:" + hashlib.sha256(f"{cb}:".encode() + "".join(chunks).encode()).hexdigest()


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
    return chunk_tree([hashlib.sha256(view[i:i + cb]).hexdigest() for i in range(0, len(data), cb)], cb) == digest


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
    digest = info.get("sha256")
    if not (isinstance(digest, str) and digest.startswith("chunks:")):
        return None
    size = path.stat().st_size
    chunks = _chunk_list(info, size)
    if chunks is None or digest != chunk_tree(chunks, CHUNK_BYTES):
        return False
    cb = CHUNK_BYTES
    with ThreadPoolExecutor(_threads()) as pool:
        got = list(pool.map(lambda i: _hash_range(path, i * cb, min(cb, size - i * cb)), range(len(chunks))))
    return got == chunks
