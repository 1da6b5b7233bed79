"""Out-of-tree backend plugins, as the capability layer sees them: device types and code families.

A plugin package declares its adapter in the ``portlayer.backends`` entry-point group
(backends/registry.py documents the contract). Descriptors are open data: a plugin can
serve a ``device_type`` the shipped schema has never heard of and declare the codegen
family its adapter realises. This module finds those declarations so that validation
(is this codegen family real?) and probing (which devices are here?) include plugins,
without the capability layer importing the backends stage.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENTRY_POINT_GROUP = "portlayer.backends"
BUILTIN_CODEGEN = ("torch", "triton", "cann")


@dataclass(frozen=True)
class Plugin:
    """One loaded entry point: its name, where it came from, and the object it named."""

    name: str
    origin: str
    dist: str
    obj: Any


@functools.cache
def _entry_points() -> tuple[tuple[Plugin, ...], tuple[str, ...]]:
    loaded, failures = [], []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep.dist, "name", "?") if ep.dist else "?"
        origin = f"entry point {ep.name!r} = {ep.value!r} (distribution {dist})"
        try:
            loaded.append(Plugin(ep.name, origin, dist, ep.load()))
        except Exception as e:  # a broken plugin must not break portlayer
            failures.append(f"skipping out-of-tree backend: {origin} failed to load: {type(e).__name__}: {e}. "
                            f"Fix or uninstall {dist}.")
    return tuple(loaded), tuple(failures)


def entry_point_plugins(refresh: bool = False, warn: bool = True) -> list[Plugin]:
    """The installed plugins that load (cached; ``refresh`` re-reads the metadata); failures warn."""
    if refresh:
        _entry_points.cache_clear()
    loaded, failures = _entry_points()
    if warn:
        for msg in failures:
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return list(loaded)


_DECLARED: dict[str, str] = {}  # codegen family -> who declared it (adapters registered in-process)


def declare_codegen_family(family: str, origin: str) -> None:
    """Called by the backend registry for every adapter it registers."""
    _DECLARED.setdefault(family, origin)


def codegen_families() -> dict[str, str]:
    """Every codegen family that exists here -> where it comes from (built in, or which plugin)."""
    out = {f: "built in" for f in BUILTIN_CODEGEN}
    for fam, origin in _DECLARED.items():
        out.setdefault(fam, origin)
    for p in entry_point_plugins(warn=False):
        fam = getattr(p.obj, "codegen_family", None) if inspect.isclass(p.obj) else None
        if isinstance(fam, str):
            out.setdefault(fam, p.origin)
    return out


def plugin_probes() -> list[tuple[str, Any]]:
    """(device_type, probe classmethod) of each plugin adapter serving a device type."""
    out = []
    for p in entry_point_plugins(warn=False):
        dtype = getattr(p.obj, "device_type", None) if inspect.isclass(p.obj) else None
        probe = getattr(p.obj, "probe", None)
        if isinstance(dtype, str) and callable(probe) and not inspect.isabstract(p.obj):
            out.append((dtype, probe))
    return out


def plugin_descriptors() -> dict[str, Path]:
    """Descriptor name (file stem) -> path, for the descriptor files plugin adapters ship."""
    out: dict[str, Path] = {}
    for p in entry_point_plugins(warn=False):
        for f in getattr(p.obj, "descriptor_files", ()) if inspect.isclass(p.obj) else ():
            path = Path(f)
            if path.suffix == ".json" and path.is_file():
                out.setdefault(path.stem, path)
    return out
