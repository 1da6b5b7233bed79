"""portlayer.runtime.serve: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

``build_app(engine, names)`` makes the app; ``serve_forever`` runs it (``portlayer serve``);
``ServerThread`` runs it on a background thread (tests, benchmarks). See docs/serving.md.
The names load on first use, so the engine-core process (core_process.py, which lives in this
package) does not import FastAPI and uvicorn.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServeError", "ServerThread", "build_app", "serve_forever"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from portlayer.runtime.serve.app import build_app

        return build_app
    if name in ("ServeError", "ServerThread", "serve_forever"):
        from portlayer.runtime.serve import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
