"""Backend registry: built-in adapters plus out-of-tree ones found through entry points.

A third party ships an adapter as a package declaring, in its metadata::

    [project.entry-points."portlayer.backends"]
    mydevice = "my_pkg.adapter:MyAdapter"

The entry point may name a BackendAdapter subclass (registered under the entry point's
name) or a module whose import registers adapters with ``@register_backend``. The adapter
declares the ``device_type`` it serves (any lowercase identifier: descriptors are open
data), its ``codegen_family`` and its own ``probe()``; a descriptor picks the adapter that
serves its device_type, whatever the adapter's registry name.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from portlayer.capabilities import plugins

if TYPE_CHECKING:
    from portlayer.backends.base import BackendAdapter
    from portlayer.capabilities.descriptor import Descriptor

ENTRY_POINT_GROUP = plugins.ENTRY_POINT_GROUP
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
    for attr in ("device_type", "codegen_family", "torch_device_type"):
        val = getattr(cls, attr, None)
        if not isinstance(val, str) or not val:
            raise TypeError(f"backend {name!r} from {origin}: {cls.__name__}.{attr} must be a non-empty string "
                            "(see backends/base.py for the adapter contract)")
    cls.name = name
    _REGISTRY[name] = cls
    _ORIGINS[name] = origin
    plugins.declare_codegen_family(cls.codegen_family, origin)


def _load_entry_points(refresh: bool) -> None:
    for p in plugins.entry_point_plugins(refresh=refresh):
        if inspect.isclass(p.obj):
            try:
                _add(p.name, p.obj, p.origin)
            except (TypeError, ValueError) as e:  # a broken plugin must not break portlayer
                import warnings

                warnings.warn(f"skipping out-of-tree backend: {e}", RuntimeWarning, stacklevel=3)


def load_backends(refresh: bool = False) -> None:
    """Import built-ins and out-of-tree adapters (once; ``refresh`` re-reads entry points)."""
    global _loaded
    if _loaded and not refresh:
        return
    for mod in BUILTIN_MODULES:
        importlib.import_module(mod)
    _load_entry_points(refresh)
    _loaded = True


def adapter_for_device_type(device_type: str) -> type[BackendAdapter] | None:
    """The adapter serving ``device_type``: the one registered under that name, else any that declares it."""
    load_backends()
    cls = _REGISTRY.get(device_type)
    if cls is not None and cls.device_type == device_type:
        return cls
    serving = [c for _, c in sorted(_REGISTRY.items()) if c.device_type == device_type]
    return serving[0] if serving else None


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
    cls = adapter_for_device_type(target.device_type)
    if cls is None:
        served = ", ".join(sorted({c.device_type for c in _REGISTRY.values()}))
        raise KeyError(
            f"descriptor {target.name!r} ({target.origin}) needs a backend for device_type {target.device_type!r}, "
            f"which no registered adapter serves (served: {served}); install its adapter package (entry-point group "
            f"{ENTRY_POINT_GROUP!r})"
        )
    if cls.codegen_family != target.codegen:
        raise KeyError(
            f"descriptor {target.name!r} ({target.origin}) asks for codegen {target.codegen!r}, but the "
            f"{target.device_type!r} adapter {cls.__name__} ({_ORIGINS[cls.name]}) generates {cls.codegen_family!r}; "
            "fix $.codegen in the descriptor"
        )
    return cls(target, index)
