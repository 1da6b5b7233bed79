"""Backend registry: built-in adapters plus out-of-tree ones found through entry points.

A third party ships an adapter as a package declaring, in its metadata::

    [project.entry-points."portlayer.backends"]
    mydevice = "my_pkg.adapter:MyAdapter"

The entry point may name a BackendAdapter subclass (registered under the entry point's
name) or a module whose import registers adapters with ``@register_backend``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from portlayer.backends.base import BackendAdapter
    from portlayer.capabilities.descriptor import Descriptor

ENTRY_POINT_GROUP = "portlayer.backends"
BUILTIN_MODULES = ("portlayer.backends.cpu", "portlayer.backends.cuda", "portlayer.backends.rocm", "portlayer.backends.xpu",
                   "portlayer.backends.ascend")

_REGISTRY: dict[str, type[BackendAdapter]] = {}
_ORIGINS: dict[str, str] = {}
_loaded = False


def register_backend(name: str) -> Callable[[type[BackendAdapter]], type[BackendAdapter]]:
    """Class decorator: make an adapter available as ``get_backend(name)``."""

    def deco(cls: type[BackendAdapter]) -> type[BackendAdapter]:
        _add(name, cls, origin=cls.__module__)
        return cls

    return deco


def _add(name: str, cls: Any, origin: str) -> None:
    from portlayer.backends.base import BackendAdapter

    if not (inspect.isclass(cls) and issubclass(cls, BackendAdapter)):
        raise TypeError(f"backend {name!r} from {origin}: {cls!r} is not a BackendAdapter subclass")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(
            f"backend {name!r} from {origin} clashes with the one from {_ORIGINS[name]}; "
            "rename one of the entry points"
        )
    cls.name = name
    _REGISTRY[name] = cls
    _ORIGINS[name] = origin


def _load_entry_points() -> None:
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep.dist, "name", "?") if ep.dist else "?"
        origin = f"entry point {ep.name!r} = {ep.value!r} (distribution {dist})"
        try:
            obj = ep.load()
            if inspect.isclass(obj):
                _add(ep.name, obj, origin)
        except Exception as e:  # a broken plugin must not break portlayer
            warnings.warn(
                f"skipping out-of-tree backend: {origin} failed to load: {type(e).__name__}: {e}. "
                f"Fix or uninstall {dist}.",
                RuntimeWarning,
                stacklevel=2,
            )


def load_backends(refresh: bool = False) -> None:
    """Import built-ins and out-of-tree adapters (once; ``refresh`` re-reads entry points)."""
    global _loaded
    if _loaded and not refresh:
        return
    for mod in BUILTIN_MODULES:
        importlib.import_module(mod)
    _load_entry_points()
    _loaded = True


def available_backends(refresh: bool = False) -> list[str]:
    """Names of every registered adapter (whether or not its device is present here)."""
    load_backends(refresh)
    return sorted(_REGISTRY)


def backend_class(name: str) -> type[BackendAdapter]:
    load_backends()
    if name not in _REGISTRY:
        raise KeyError(
            f"no backend named {name!r}; registered: {', '.join(sorted(_REGISTRY))}. Out-of-tree adapters "
            f"register through the {ENTRY_POINT_GROUP!r} entry-point group."
        )
    return _REGISTRY[name]


def backend_origin(name: str) -> str:
    load_backends()
    return _ORIGINS[name]


def get_backend(target: str | Descriptor, index: int = 0) -> BackendAdapter:
    """An adapter for a backend name ('cuda'), a descriptor name/path, or a Descriptor.

    A descriptor picks the adapter registered under its device_type and is passed to it,
    so allocation alignment and graph-capture support follow the descriptor.
    """
    from portlayer.capabilities.descriptor import Descriptor, DescriptorError, load_descriptor

    load_backends()
    if isinstance(target, str) and target in _REGISTRY:
        return _REGISTRY[target](None, index)
    if isinstance(target, str):
        try:
            target = load_descriptor(target)
        except DescriptorError as e:
            if e.rule != "known_descriptor":
                raise
            raise KeyError(
                f"{target!r} is neither a backend ({', '.join(sorted(_REGISTRY))}) nor a shipped descriptor; "
                "pass a descriptor .json path or run `portlayer devices`"
            ) from None
    assert isinstance(target, Descriptor)
    if target.device_type not in _REGISTRY:
        raise KeyError(
            f"descriptor {target.name!r} ({target.origin}) needs a {target.device_type!r} backend, which is not "
            f"registered (have: {', '.join(sorted(_REGISTRY))}); install its adapter package"
        )
    return _REGISTRY[target.device_type](target, index)
