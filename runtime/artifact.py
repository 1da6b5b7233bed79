"""The compiled-artifact directory: atomic writing, the manifest, and verification on load.

An artifact travels to machines that never saw the model, so nothing in it is trusted:
every file is listed in manifest.json with its kind and digest (its sha256; for a big file the sha256 of its
64 MiB chunks' sha256s, "chunks:...", with the chunk list: runtime/file_hash.py), and `verify_artifact`
refuses a missing, modified or unlisted file (naming it) before any generated code runs.
Writes go to a temporary sibling directory renamed into place, so a crash or a
concurrent compile never leaves a half-written artifact under the final name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from portlayer.errors import PortlayerError
from portlayer.runtime.file_hash import ChunkCheck, bytes_match, chunks_match, hashes
from portlayer.runtime.output_dir import check_output_dir, is_artifact_dir, replace_dir  # noqa: F401 - re-exported

FORMAT = "portlayer.artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
GRAPH = "graph.json"
WEIGHTS = "weights.safetensors"
PLAN = "plan.json"
CAPABILITY = "capability.json"
VALIDATION = "validation.json"
VALIDATION_TENSORS = "validation.safetensors"
TOKENIZER_DIR = "tokenizer"
SOURCE_DIR = "generated"

#: every file kind an artifact may hold; anything a backend generates is a "source"
KINDS = ("graph", "weights", "plan", "capability", "validation", "tokenizer", "source")
FIXED_KINDS = {
    GRAPH: "graph", WEIGHTS: "weights", PLAN: "plan", CAPABILITY: "capability",
    VALIDATION: "validation", VALIDATION_TENSORS: "validation",
}  # fmt: skip
#: files up to this size are held in memory from verification on (what load() checked is what runs)
HOLD_MAX_BYTES = 64 << 20


class ArtifactError(PortlayerError):
    """An artifact is missing, damaged, tampered with, or built for another device."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def toolkit_versions() -> dict[str, str]:
    """Versions recorded in every manifest (and reported when they differ at load time)."""
    import torch

    from portlayer import __version__

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # triton is optional on CPU-only or Ascend hosts
        triton_version = "absent"
    return {
        "portlayer": __version__,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": ".".join(map(str, sys.version_info[:3])),
        "artifact_format": str(FORMAT_VERSION),
    }


def _walk(root: Path) -> Iterator[str]:
    """Every entry under ``root`` that is not a directory (files, symlinks, FIFOs, ...), manifest excluded.

    Nothing is skipped: a ``__pycache__`` or any other file the manifest does not list is reported."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        links = [d for d in dirnames if (base / d).is_symlink()]
        for name in sorted(filenames + links):
            rel = (base / name).relative_to(root).as_posix()
            if rel != MANIFEST:
                yield rel
        dirnames[:] = sorted(d for d in dirnames if d not in links)


def kind_of(rel: str, declared: Mapping[str, str]) -> str:
    if rel in declared:
        return declared[rel]
    if rel in FIXED_KINDS:
        return FIXED_KINDS[rel]
    if rel.startswith(TOKENIZER_DIR + "/"):
        return "tokenizer"
    return "source"


# ---- writing ---------------------------------------------------------------------------
class ArtifactWriter:
    """Stage files in a temporary sibling of ``final``; ``commit`` hashes them and renames.

    Use as a context manager: an exception (or no commit) removes the staging directory.
    """

    def __init__(self, final: str | os.PathLike[str]) -> None:
        self.final = Path(final).resolve()
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.dir = self.final.parent / f".{self.final.name}.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir()
        self.kinds: dict[str, str] = {}
        self.committed = False

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.committed:
            shutil.rmtree(self.dir, ignore_errors=True)

    def declare(self, path: str | os.PathLike[str], kind: str) -> None:
        """Record the kind of a file written under the staging directory."""
        if kind not in KINDS:
            raise ValueError(f"unknown artifact file kind {kind!r}; kinds: {', '.join(KINDS)}")
        p = Path(path)
        rel = (p.relative_to(self.dir) if p.is_absolute() else p).as_posix()
        self.kinds[rel] = kind

    def write_json(self, rel: str, data: Any, kind: str) -> Path:
        path = self.dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n")
        self.declare(rel, kind)
        return path

    def commit(self, manifest: Mapping[str, Any]) -> Path:
        """Hash every staged file into manifest.json, then move the directory into place."""
        files = {}
        for rel in _walk(self.dir):
            p = self.dir / rel
            # big files also get per-chunk sha256, checked in parallel on load (runtime/file_hash.py)
            files[rel] = {"kind": kind_of(rel, self.kinds), **hashes(p), "bytes": p.stat().st_size}
        doc = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created_unix": int(time.time()),
            "versions": toolkit_versions(),
            **manifest,
            "files": files,
        }
        (self.dir / MANIFEST).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        replace_dir(self.dir, self.final)
        self.committed = True
        return self.final


_replace_dir = replace_dir  # the old private name


# ---- reading and verifying --------------------------------------------------------------
@dataclass(frozen=True)
class Manifest:
    path: Path
    raw: dict[str, Any] = field(repr=False)
    #: bytes of the files verify_artifact checked (all but the large ones): later reads use these
    held: Mapping[str, bytes] = field(default_factory=dict, repr=False, compare=False)
    #: (inode, size, mtime_ns) of each larger file when its sha256 check began: it is mapped only if unchanged
    checked: Mapping[str, tuple[int, int, int]] = field(default_factory=dict, repr=False, compare=False)
    #: the big files' chunk check still running (verify_artifact(wait=False)); join_verification joins it
    pending: PendingVerification | None = field(default=None, repr=False, compare=False)

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        return self.raw["files"]

    @property
    def target(self) -> dict[str, Any]:
        return self.raw.get("target", {})

    @property
    def model(self) -> dict[str, Any]:
        return self.raw.get("model", {})

    @property
    def versions(self) -> dict[str, str]:
        return self.raw.get("versions", {})

    def files_of(self, kind: str) -> list[str]:
        return [rel for rel, f in self.files.items() if f.get("kind") == kind]

    def recompile_command(self, target: str) -> str:
        spec = self.model.get("spec") or "MODEL"
        opts = self.raw.get("options", {})
        # the compile's options as `portlayer compile` flags: sources_only=True -> --sources-only, verify=False ->
        # --no-verify, quantize=int4 -> --quantize int4
        extra = "".join(f" --{'no-' if v is False else ''}{k.replace('_', '-')}"
                        + ("" if isinstance(v, bool) else f" {_shell_word(v)}") for k, v in opts.items()
                        if isinstance(v, bool) or v not in (None, "", 0))
        return f"portlayer compile {_shell_word(spec)} --target {_shell_word(target)}{extra}"


def _shell_word(s: str) -> str:
    import shlex

    return shlex.quote(str(s))


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Parse manifest.json; every problem is an ArtifactError naming the file and the fix."""
    root = Path(directory)
    if not root.exists():
        raise ArtifactError(f"{root}: no such artifact directory; compile one with `portlayer compile MODEL -o {root}`")
    if not root.is_dir():
        raise ArtifactError(f"{root}: not a directory; an artifact is the directory `portlayer compile` writes")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{mpath}: missing; {root} is not a portlayer artifact (or was copied incompletely)")
    try:
        raw = json.loads(_read_bytes(mpath))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ArtifactError(f"{mpath}: not valid JSON ({e}); the artifact is damaged, recompile it") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise ArtifactError(f"{mpath}: format is {found!r}, expected {FORMAT!r}; not a portlayer artifact manifest")
    if raw.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{mpath}: artifact format_version {raw.get('format_version')!r}, this portlayer reads {FORMAT_VERSION}; "
            "recompile with this portlayer"
        )
    files = raw.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(f, dict) and isinstance(f.get("sha256"), str) and f.get("kind") in KINDS for f in files.values()
    ):
        raise ArtifactError(f"{mpath}: 'files' must map each path to {{kind, sha256, bytes}}; the manifest is damaged")
    return Manifest(root, raw)


def verify_artifact(directory: str | os.PathLike[str], *, wait: bool = True) -> Manifest:
    """Check every listed file's sha256 and refuse unlisted ones, before anything is loaded.

    Each file is read once; the returned Manifest holds the bytes of every file up to
    HOLD_MAX_BYTES (all generated sources, the graph, the plan), so what runs later is what
    was checked here even if the directory changes afterwards. Larger files (weights) are
    checked again against the manifest when they are read (read_verified_bytes), or mapped
    only while unchanged since their check (open_verified_weights).

    ``wait=False`` (the load, runtime/loaded.py) checks the big files that carry chunk hashes in a
    background pool of threads instead of here: the Manifest's ``pending`` holds that check, and
    whoever uses the weights must call ``join_verification`` first (the mapping and copying may go
    on meanwhile). Everything small (sources, graph, plan, descriptor) is checked here either way.
    """
    m = read_manifest(directory)
    root = m.path
    problems = []
    held: dict[str, bytes] = {}
    checked: dict[str, tuple[int, int, int]] = {}
    background = None if wait else ChunkCheck()
    try:
        for rel, info in m.files.items():
            p = root / rel
            if ".." in Path(rel).parts or Path(rel).is_absolute() or rel == MANIFEST:
                problems.append(f"{rel} ({info['kind']}): path escapes the artifact directory")
            elif p.is_symlink() or any(q.is_symlink() for q in _parents_below(root, p)):
                problems.append(f"{rel} ({info['kind']}): a symbolic link (an artifact holds regular files only)")
            elif not p.is_file():
                problems.append(f"{rel} ({info['kind']}): missing")
            elif p.stat().st_size != info.get("bytes", p.stat().st_size):
                problems.append(f"{rel} ({info['kind']}): {p.stat().st_size} bytes, manifest says {info['bytes']} (truncated or modified)")
            elif p.stat().st_size <= HOLD_MAX_BYTES:
                data = _read_bytes(p)
                if not bytes_match(data, info):
                    problems.append(f"{rel} ({info['kind']}): sha256 differs from the manifest (modified)")
                else:
                    held[rel] = data
            else:
                before = _stat_key(p)
                queued = background.add(rel, p, info) if background is not None else None
                if queued:  # hashed in the background: mapped only while unchanged, joined before use
                    checked[rel] = before
                    continue
                ok = chunks_match(p, info) if queued is None else False  # parallel chunk hashes, when it has them
                if not (ok if ok is not None else sha256_file(p) == info["sha256"]):
                    problems.append(f"{rel} ({info['kind']}): sha256 differs from the manifest (modified)")
                elif _stat_key(p) == before:
                    checked[rel] = before
        for rel in _walk(root):
            if rel not in m.files:
                problems.append(f"{rel}: not listed in the manifest (added after compile)")
        if problems:
            raise _refusal(m, problems)
        for kind in ("graph", "weights", "plan", "capability"):
            if not m.files_of(kind):
                raise ArtifactError(f"{root / MANIFEST}: lists no {kind} file; the artifact is incomplete, recompile it")
    except BaseException:
        if background is not None:
            background.cancel()
        raise
    pending = None
    if background is not None:
        background.seal()
        if not background.empty:
            pending = PendingVerification(root, background, {r: checked[r] for r in background.keys()})
    return Manifest(root, m.raw, held, checked, pending)


def _refusal(m: Manifest, problems: list[str]) -> ArtifactError:
    return ArtifactError(
        f"artifact {m.path} failed verification, refusing to load it:\n  - " + "\n  - ".join(problems)
        + "\nRecompile it (`" + m.recompile_command(m.target.get("name", "auto")) + "`) or restore the files."
    )


class PendingVerification:
    """The big files' chunk check, started by verify_artifact(wait=False) and joined once by
    ``join_verification``: the hashes, then each file's (inode, size, mtime) against the one taken
    when its check began (a file replaced or modified during the load is refused)."""

    def __init__(self, root: Path, check: ChunkCheck, keys: Mapping[str, tuple[int, int, int]]) -> None:
        self.root, self.check, self.keys = root, check, dict(keys)
        self._lock = threading.Lock()
        self._problems: list[str] | None = None
        self.waited_s = 0.0  # how long the join waited for the hashing

    @property
    def seconds(self) -> float | None:
        """From the check's start to its last chunk hashed (None while it runs)."""
        return None if self.check.finished is None else self.check.finished - self.check.started

    def join(self, kinds: Mapping[str, str]) -> list[str]:
        with self._lock:
            if self._problems is None:
                t0 = time.perf_counter()
                bad = self.check.wait()
                self.waited_s = time.perf_counter() - t0
                problems = [f"{rel} ({kinds.get(rel, '?')}): {why}" for rel, why in bad.items()]
                for rel, key in self.keys.items():
                    if rel in bad:
                        continue
                    try:
                        now = _stat_key(self.root / rel)
                    except OSError:
                        now = None
                    if now != key:
                        problems.append(f"{rel} ({kinds.get(rel, '?')}): replaced or modified while it was being "
                                        "verified (inode, size or modification time changed); load it again")
                self._problems = problems
            return list(self._problems)

    def cancel(self) -> None:
        self.check.cancel()


def join_verification(m: Manifest) -> None:
    """Wait for the background part of ``verify_artifact(wait=False)`` (no-op when there is none); a
    mismatch raises the ArtifactError verify_artifact would have raised. Call it before the weights
    are used: before the first program step, before an executable or graph reaches the user."""
    if m.pending is None:
        return
    problems = m.pending.join({rel: str(f.get("kind")) for rel, f in m.files.items()})
    if problems:
        raise _refusal(m, problems)


def _parents_below(root: Path, p: Path) -> list[Path]:
    out, q = [], p.parent
    while q != root and root in q.parents:
        out.append(q)
        q = q.parent
    return out


def _read_bytes(p: Path) -> bytes:
    with open(p, "rb") as f:
        return f.read()


def read_verified_bytes(m: Manifest, rel: str) -> bytes:
    """The bytes of artifact member ``rel``: held since verification, or read now and checked
    against the manifest loaded then (a file replaced after load() is refused, not used)."""
    if rel in m.held:
        return m.held[rel]
    info = m.files.get(rel)
    if info is None:
        raise ArtifactError(f"{m.path / rel}: not listed in {m.path / MANIFEST}; the artifact is incomplete, recompile it")
    data = _read_bytes(m.path / rel)
    if not bytes_match(data, info):
        raise ArtifactError(f"{m.path / rel} ({info['kind']}): changed since the artifact was verified (sha256 differs "
                            "from the manifest); reload it, or restore the file")
    return data


def _stat_key(p: Path) -> tuple[int, int, int]:
    st = p.stat()
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def open_verified_weights(m: Manifest, rel: str) -> Any:
    """Tensors of the safetensors member ``rel``: from the held bytes, or memory-mapped (safe_open)
    when the file is still the one whose sha256 verification checked (same inode, size and mtime),
    so a big model is never read into memory whole; a file changed since is refused."""
    if rel in m.held or rel not in m.checked:
        from safetensors.torch import load

        return load(read_verified_bytes(m, rel))
    p = m.path / rel
    if _stat_key(p) != m.checked[rel]:
        raise ArtifactError(f"{p} ({m.files[rel]['kind']}): changed since the artifact was verified (size or "
                            "modification time differs); reload it, or restore the file")
    from portlayer.flatten.weights_stream import open_safetensors

    return open_safetensors(p)


def verified_sources(m: Manifest) -> Any:
    """The artifact's generated sources (codegen.source_loader.VerifiedSources) from the held bytes."""
    from portlayer.codegen.source_loader import VerifiedSources

    rels = m.files_of("source")
    missing = [r for r in rels if r not in m.held]
    if missing:
        raise ArtifactError(f"artifact {m.path}: generated sources {missing[:3]} were not held at verification "
                            f"(over {HOLD_MAX_BYTES} bytes, or the manifest was not verified); recompile it")
    return VerifiedSources(m.path.resolve(), {r: m.held[r] for r in rels}, verified=True)


def read_json_file(m: Manifest, rel: str) -> Any:
    """A verified JSON member of the artifact; malformed content is an ArtifactError naming it."""
    p = m.path / rel
    try:
        return json.loads(read_verified_bytes(m, rel))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ArtifactError(
            f"{p}: not valid JSON ({e}); the artifact is damaged, recompile it: "
            f"`{m.recompile_command(m.target.get('name', 'auto'))}`"
        ) from None


def version_notes(m: Manifest) -> list[str]:
    """Human lines for each toolkit version that differs from the one that built the artifact."""
    here = toolkit_versions()
    notes = []
    for k in ("portlayer", "torch", "triton"):
        built = m.versions.get(k)
        if built and built != here.get(k):
            notes.append(f"{k} {built} built this artifact, this is {k} {here.get(k)}")
    if notes:
        cmd = m.recompile_command(m.target.get("name", "auto"))
        notes.append(f"if `portlayer validate` fails, recompile: `{cmd}`")
    return notes


# ---- device match ------------------------------------------------------------------------
def emulated_device(m: Manifest) -> Any:
    """The stand-in device for running a CANN (Ascend) artifact on portlayer's CPU emulator of the
    torch_npu calls (backends/ascend_emulator.py). Only CANN artifacts can be emulated; the real
    device check is not weakened, it is replaced by an explicit request (``emulate=True``)."""
    from portlayer.capabilities.probe import DetectedDevice

    if m.target.get("codegen") != "cann":
        raise ArtifactError(
            f"artifact {m.path} targets {m.target.get('name')} (codegen {m.target.get('codegen')}); only CANN (Ascend) "
            "artifacts can run on the CPU emulator. Drop emulate / PORTLAYER_ASCEND_EMULATOR for this artifact."
        )
    return DetectedDevice("ascend", 0, "Ascend CPU emulator (torch_npu calls emulated in torch; not an NPU)",
                          str(m.target.get("arch")), "cpu", m.target.get("name"), "emulated",
                          "explicitly requested: emulate=True / --emulate-ascend / PORTLAYER_ASCEND_EMULATOR=1")


def check_device(m: Manifest, devices: list[Any] | None = None) -> Any:
    """The local DetectedDevice that can run the artifact: same arch and codegen family.

    Otherwise an ArtifactError saying what the artifact expects, what this machine has
    (including why accelerators were skipped) and the command that recompiles for it.
    """
    from portlayer.capabilities.descriptor import load_descriptor
    from portlayer.capabilities.probe import default_target, probe_devices

    want_arch, want_codegen = m.target.get("arch"), m.target.get("codegen")
    devices = probe_devices() if devices is None else devices
    found = []
    for d in devices:
        if not d.usable:
            found.append(f"{d.device_type}: skipped ({d.reason})")
            continue
        desc = load_descriptor(d.descriptor) if d.descriptor else None
        codegen = desc.codegen if desc else "?"
        if codegen == want_codegen and want_arch in (d.arch, desc.arch if desc else None):
            return d
        found.append(f"{d.torch_device} {d.name} (arch {d.arch}, codegen {codegen}, descriptor {d.descriptor})")
    try:
        local = default_target(devices)
        here = local.name if Path(local.origin).parent.name == "devices" else local.origin
    except Exception:  # no descriptor at all: still tell the user what to run
        here = "auto"
    raise ArtifactError(
        f"artifact {m.path} was compiled for {m.target.get('name')} ({m.target.get('device_type')}, "
        f"arch {want_arch}, codegen {want_codegen}), but no device here matches.\n"
        f"  expected: a device with arch {want_arch} and codegen {want_codegen} ({m.target.get('device_type')})\n"
        "  found:    " + "\n            ".join(found or ["no usable device"]) + "\n"
        f"Recompile for this machine: {m.recompile_command(here)}"
    )
