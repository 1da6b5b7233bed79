"""Where `portlayer compile -o DIR` may write: only over a portlayer artifact or an empty directory.

A user's directory that happens to hold a ``manifest.json`` (a web app's, say) is never
replaced: the manifest's ``format`` field must say it is a portlayer artifact. The swap is
a rename, and a failed rename puts the old artifact back, so nothing is lost either way.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path


def is_artifact_dir(path: Path) -> bool:
    """True when ``path`` holds a portlayer artifact manifest (its ``format`` field says so)."""
    from portlayer.runtime.artifact import FORMAT, MANIFEST

    mpath = path / MANIFEST
    if not mpath.is_file() or mpath.is_symlink():
        return False
    try:
        raw = json.loads(mpath.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and raw.get("format") == FORMAT


def check_output_dir(final: Path) -> None:
    """Refuse an output path that exists and is neither a portlayer artifact nor an empty directory."""
    from portlayer.runtime.artifact import MANIFEST, ArtifactError

    if final.is_symlink():
        raise ArtifactError(f"{final} is a symbolic link; pass a real directory path to -o (nothing was written)")
    if not final.exists():
        return
    if not final.is_dir():
        raise ArtifactError(f"{final} exists and is a file, not an artifact directory; pass a new or empty directory "
                            "to -o, or remove it first (nothing was written)")
    if is_artifact_dir(final) or not any(final.iterdir()):
        return
    what = "its manifest.json is not a portlayer artifact manifest" if (final / MANIFEST).exists() else f"no {MANIFEST}"
    raise ArtifactError(
        f"{final} exists and is not a portlayer artifact ({what}); pass an empty or new directory to -o, or remove "
        "it first (nothing was written or removed)"
    )


def replace_dir(staged: Path, final: Path) -> None:
    """Rename ``staged`` to ``final``; an existing artifact (or empty dir) there is swapped out, anything else refused."""
    from portlayer.runtime.artifact import ArtifactError

    try:
        check_output_dir(final)
    except ArtifactError:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if final.exists():
        trash = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, trash)
        try:
            os.rename(staged, final)
        except OSError:
            os.rename(trash, final)  # put the old artifact back: nothing is lost
            raise
        shutil.rmtree(trash, ignore_errors=True)
        return
    os.rename(staged, final)
