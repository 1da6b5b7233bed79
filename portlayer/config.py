"""Process-wide settings every stage may read: where portlayer keeps its cache, thread-count knobs.

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


def positive_int_env(name: str, default: int, what: str) -> int:
    """$``name`` as a count (at least 1; unset or empty: ``default``); a value that is not an integer raises
    a ValueError naming the variable and ``what`` it counts."""
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        return max(1, int(raw))
    except ValueError:
        raise ValueError(f"{name}={raw!r}: want a positive integer ({what})") from None
