"""Shared builders of the bad-input suite: real artifacts compiled from the GraphBuilder sample
(no capture, so they build in seconds) and copies of them that a test may damage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from artifact_samples import sample_graph


def compile_sample(out: Path, target: str = "cpu-x86_64", **kwargs) -> Path:
    import portlayer

    return portlayer.compile(sample_graph(), target=target, output=out, progress=False, **kwargs).path


def copy_artifact(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes: a test compares it before and after to show nothing was lost."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def edit_manifest(art: Path, fn) -> None:
    m = json.loads((art / "manifest.json").read_text())
    fn(m)
    (art / "manifest.json").write_text(json.dumps(m))


def reference_logits(feeds: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sample graph on the reference interpreter (the semantics every program must match)."""
    from portlayer.runtime.executable import ReferenceExecutable

    return ReferenceExecutable(sample_graph()).run(feeds, None, None)[0]


def feeds(n: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"input_ids": torch.randint(0, 32, (n,), generator=g), "positions": torch.arange(n)}
