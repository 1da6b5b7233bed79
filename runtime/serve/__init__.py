"""portlayer.runtime.serve: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

``build_app(engine, names)`` makes the app; ``serve_forever`` runs it (``portlayer serve``);
``ServerThread`` runs it on a background thread (tests, benchmarks). See docs/serving.md.
"""

from __future__ import annotations

from portlayer.runtime.serve.app import build_app
from portlayer.runtime.serve.server import ServeError, ServerThread, serve_forever

__all__ = ["ServeError", "ServerThread", "build_app", "serve_forever"]
