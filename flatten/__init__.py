"""Flat Model IR: capture, ops, printing, serialisation, verification, interpretation.

The names below are imported on first use (PEP 562), so loading an artifact, which needs the IR
but not capture (transformers, torch.export), does not pay for importing them (issue 20).
"""

import importlib
import sys
import types
from typing import Any

# What the eager imports made before anything else (cheap; no transformers): the op registry, since
# op_defs.attention and op_defs.mla import each other through it, and the torch.ops.portlayer custom ops
# the aten converters name (flatten/from_export_compute.py).
from portlayer.flatten import hf_attention as _hf_attention  # noqa: F401
from portlayer.flatten import ops as _ops  # noqa: F401

#: public name -> the submodule that defines it
_LAZY = {
    "CaptureError": "capture", "capture": "capture",
    "ExecContext": "interpret", "interpret": "interpret", "run_graph": "interpret",
    "Graph": "ir", "GraphBuilder": "ir", "Node": "ir", "TensorType": "ir", "Value": "ir",
}  # fmt: skip

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    sub = _LAZY.get(name)
    if sub is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{sub}"), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """``capture`` and ``interpret`` name both a submodule and its function; the package attribute
    is the function (as the eager ``from .capture import capture`` made it), even after the import
    system binds the submodule to the package on its first import."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == name and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
