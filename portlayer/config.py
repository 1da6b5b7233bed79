"""Process-wide settings every stage may read: where portlayer keeps its cache.

A leaf module (it imports nothing from portlayer), so any stage can use it without
breaking the stage order of docs/architecture.md.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PORTLAYER_CACHE"


def cache_root() -> Path:
    """$PORTLAYER_CACHE, else ~/.cache/portlayer: artifacts, captures, materialised models, Triton's cache."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "portlayer"))
