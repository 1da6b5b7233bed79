"""Make ``import portlayer`` work from a plain checkout (the GPU machine has no install).

setup.cfg maps portlayer.<folder> -> <folder>; this builds the same layout with symlinks
in a temporary directory and puts it first on sys.path.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("flatten", "passes", "backends", "codegen", "runtime", "capabilities")


def bootstrap() -> None:
    try:
        import portlayer.codegen  # noqa: F401

        return
    except ImportError:
        pass
    root = Path(tempfile.mkdtemp(prefix="portlayer-src-"))
    pkg = root / "portlayer"
    pkg.mkdir()
    for f in (REPO / "portlayer").iterdir():
        os.symlink(f, pkg / f.name)
    for sub in SUBPACKAGES:
        os.symlink(REPO / sub, pkg / sub)
    sys.path.insert(0, str(root))
