"""The content-addressed artifact cache: a second compile of the same thing is free.

The key covers everything that changes the artifact: the model's files (or tensors), the
descriptor's canonical JSON, the compile options and the toolkit (versions plus a
fingerprint of portlayer's own sources, so a developer editing a pass is not served a
stale artifact). One file lock per key makes concurrent compiles of one key build once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from portlayer.config import cache_root as _cache_root
from portlayer.errors import PortlayerError
from portlayer.runtime.artifact import (
    MANIFEST,
    ArtifactError,
    read_manifest,
    toolkit_versions,
    verify_artifact,
)

#: file name patterns that make up a model (others, e.g. ONNX exports in the same dir, are ignored)
MODEL_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".bin", ".py", ".jinja")
LOCK_TIMEOUT_S = 3600


def cache_root() -> Path:
    return _cache_root()


def artifacts_dir() -> Path:
    return cache_root() / "artifacts"


def _sha(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---- hashing what goes into the key -------------------------------------------------------
def _memo_path() -> Path:
    return cache_root() / "file-hashes.json"


def _stat_key(st: os.stat_result) -> list[int]:
    """What a memoised digest is valid for: size, mtime, inode and ctime (ctime cannot be set back
    by a user, so a file rewritten and given its old mtime again is hashed again)."""
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def model_files(directory: Path) -> list[Path]:
    """The files of an HF directory that go into its hash (the weights actually loaded, config, tokenizer)."""
    files = sorted(
        p for p in directory.rglob("*")
        if p.is_file() and p.suffix in MODEL_SUFFIXES and not any(s.startswith(".") for s in p.relative_to(directory).parts)
    )  # fmt: skip
    if any(p.suffix == ".safetensors" for p in files):
        files = [p for p in files if p.suffix != ".bin"]  # the weights actually loaded
    return files


def _read_memo() -> dict[str, Any]:
    try:
        memo = json.loads(_memo_path().read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _memo_hit(memo: dict[str, Any], path: Path, st: os.stat_result) -> str | None:
    hit = memo.get(str(path.resolve()))
    if isinstance(hit, list) and len(hit) == 5 and hit[:4] == _stat_key(st) and isinstance(hit[4], str):
        return hit[4]
    return None


def needs_hashing(directory: Path) -> int:
    """Bytes of the model files whose digest is not memoised (what model_dir_hash will read)."""
    memo = _read_memo()
    return sum(st.st_size for p in model_files(directory) if _memo_hit(memo, p, st := p.stat()) is None)


def model_dir_hash(directory: Path) -> str:
    """sha256 over the model files of an HF directory.

    Each file's digest is runtime/file_hash.content_digests (big files by parallel chunk hashes),
    memoised by size, mtime, inode and ctime: a second compile of unchanged weights reads nothing."""
    from portlayer.runtime.file_hash import content_digests

    memo = _read_memo()
    files = model_files(directory)
    stats = [p.stat() for p in files]
    digests = [_memo_hit(memo, p, st) for p, st in zip(files, stats)]
    todo = [i for i, d in enumerate(digests) if d is None]
    for i, d in zip(todo, content_digests([files[i] for i in todo])):
        after = files[i].stat()
        if _stat_key(after) != _stat_key(stats[i]):
            raise ModelChangedError(f"{files[i]}: changed while it was being hashed; compile again once it is complete")
        digests[i] = d
        memo[str(files[i].resolve())] = [*_stat_key(stats[i]), d]
    entries = [(p.relative_to(directory).as_posix(), d) for p, d in zip(files, digests)]
    if todo:
        try:
            memo_file = _memo_path()
            memo_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo_file.with_name(f".{memo_file.name}.{uuid.uuid4().hex[:8]}")
            tmp.write_text(json.dumps(memo))
            os.replace(tmp, memo_file)
        except OSError:
            pass  # the memo is an optimisation only
    return _sha(entries)


class ModelChangedError(PortlayerError):
    """A model file changed while its hash was computed (still being written or copied)."""


def tensors_hash(tensors: Mapping[str, Any], extra: Any = None) -> str:
    """sha256 over named tensors (and a JSON-able ``extra``), for in-memory modules and graphs."""
    h = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        h.update(t.view(-1).view(__import__("torch").uint8).numpy() if t.numel() else b"")  # no copy of the bytes
    return h.hexdigest()


@functools.cache
def toolkit_fingerprint() -> str:
    """sha256 of portlayer's sources, templates and descriptors (changes on any edit).

    Computed once per process: the code a process imported is the code that compiles.
    PORTLAYER_FINGERPRINT pins it (CI, or a shared checkout others keep editing).
    """
    import portlayer

    if os.environ.get("PORTLAYER_FINGERPRINT"):
        return os.environ["PORTLAYER_FINGERPRINT"]

    roots = set()
    for sub in ("", ".flatten", ".passes", ".backends", ".codegen", ".runtime", ".capabilities"):
        try:
            mod = __import__("portlayer" + sub, fromlist=["_"])
        except ImportError:
            continue
        if getattr(mod, "__file__", None):  # __path__ of an editable install may hold the repo root
            roots.add(Path(mod.__file__).parent)
    h = hashlib.sha256(portlayer.__version__.encode())
    for root in sorted(roots):
        for p in sorted(root.rglob("*")):
            if p.suffix in (".py", ".j2", ".json") and "__pycache__" not in p.parts and p.is_file():
                h.update(p.relative_to(root).as_posix().encode())
                h.update(p.read_bytes())
    return h.hexdigest()


def cache_key(model_sha: str, descriptor_sha: str, options: Mapping[str, Any]) -> str:
    toolkit = {k: v for k, v in toolkit_versions().items() if k != "python"}
    return _sha({"model": model_sha, "descriptor": descriptor_sha, "options": dict(options),
                 "toolkit": toolkit, "sources": toolkit_fingerprint()})


# ---- lookup, build under a lock, list, clear ------------------------------------------------
def entry_path(key: str) -> Path:
    return artifacts_dir() / key[:24]


def lookup(key: str) -> Path | None:
    """The cached artifact for ``key`` if it exists and verifies; a damaged one is removed."""
    path = entry_path(key)
    if not (path / MANIFEST).is_file():
        return None
    try:
        m = verify_artifact(path)
    except ArtifactError:
        return None
    return path if m.raw.get("cache_key") == key else None


def get_or_build(key: str, build: Callable[[Path], Path]) -> tuple[Path, bool]:
    """(artifact path, cache hit). ``build(final_path)`` writes the artifact atomically.

    The lock is taken only on a miss; after it is acquired the cache is checked again, so
    a second process waiting on the first finds its artifact instead of building again.
    """
    from filelock import FileLock

    hit = lookup(key)
    if hit:
        return hit, True
    lock_dir = cache_root() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_dir / f"{key[:24]}.lock"), timeout=LOCK_TIMEOUT_S):
        hit = lookup(key)
        if hit:
            return hit, True
        path = entry_path(key)
        if path.exists():  # damaged or stale entry: replace it
            why = _remove(path)
            if why:
                raise CacheClearError(f"the damaged cache entry {path} cannot be replaced ({why}); remove it by hand "
                                      "or point PORTLAYER_CACHE at a writable directory")
        return build(path), False


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    key: str
    model: str
    target: str
    options: dict[str, Any]
    created_unix: int
    bytes: int
    status: str  # "ok" or why the entry is unusable


def list_entries() -> list[CacheEntry]:
    out = []
    root = artifacts_dir()
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if not p.is_dir() or p.name.startswith("."):
            continue
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        try:
            m = read_manifest(p)
            status = "ok"
        except ArtifactError as e:
            out.append(CacheEntry(p, p.name, "?", "?", {}, 0, size, f"damaged: {str(e).splitlines()[0]}"))
            continue
        out.append(CacheEntry(
            p, m.raw.get("cache_key", p.name), m.model.get("spec", "?"), m.target.get("name", "?"),
            dict(m.raw.get("options", {})), int(m.raw.get("created_unix", 0)), size, status,
        ))  # fmt: skip
    return out


def _remove(path: Path) -> str | None:
    """Remove a cache entry (renamed aside first, so readers never see half of one); None when
    it is gone, else why it could not be removed."""
    trash = path.parent / f".{path.name}.removing-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    errors: list[str] = []
    shutil.rmtree(trash, onerror=lambda _f, p, exc: errors.append(f"{p}: {exc[1]}"))
    return errors[0] if errors else None


class CacheClearError(PortlayerError):
    """Some cache entries could not be removed (a read-only or foreign-owned cache)."""


def clear(everything: bool = False) -> int:
    """Remove cached artifacts (and, with ``everything``, captured graphs, materialised models and
    hash memos). Returns how many artifacts were removed; raises CacheClearError naming what was
    not (nothing is reported removed that is still there)."""
    n = 0
    failures: list[str] = []
    root = artifacts_dir()
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if not p.is_dir() or p.is_symlink():
            continue
        why = _remove(p)
        if why:
            failures.append(why)
        elif not p.name.startswith("."):
            n += 1
    if everything:
        for sub in ("models", "captured", "locks"):
            d = cache_root() / sub
            if d.is_dir():
                why = _remove(d)
                if why:
                    failures.append(why)
        try:
            _memo_path().unlink(missing_ok=True)
        except OSError as e:
            failures.append(f"{_memo_path()}: {e.strerror or e}")
    if failures:
        raise CacheClearError(f"removed {n} cached artifact(s) from {cache_root()}, but {len(failures)} could not be "
                              "removed (is the cache read-only or owned by another user?):\n  - " + "\n  - ".join(failures[:10]))
    return n


def iter_sizes() -> Iterator[tuple[str, int]]:
    """(what, bytes) for each cache area, for `portlayer cache list`."""
    root = cache_root()
    for sub in ("artifacts", "captured", "models"):
        d = root / sub
        yield sub, sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) if d.is_dir() else 0
