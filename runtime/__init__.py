"""portlayer.runtime: the serving engine (scheduler, block manager, model runner, sampler) and artifacts.

``from portlayer.runtime import LLMEngine, SamplingParams``; names resolve on first use so
importing a submodule (e.g. runtime.artifact) does not load the engine.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "LLMEngine": "portlayer.runtime.engine",
    "Engine": "portlayer.runtime.engine",
    "EngineConfig": "portlayer.runtime.engine",
    "SamplingParams": "portlayer.runtime.sequence",
    "RequestOutput": "portlayer.runtime.sequence",
    "RequestRejected": "portlayer.runtime.sequence",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'portlayer.runtime' has no attribute {name!r}")
