"""Running the app under uvicorn: in the foreground (``portlayer serve``) or on a thread (tests).

The listening socket is bound here, before uvicorn starts, so a busy port is a clear error
that names the address instead of a log line and ``sys.exit`` inside uvicorn. Shutdown is
uvicorn's graceful one: stop accepting, let in-flight requests finish for up to
``shutdown_timeout`` seconds, cancel the rest (their engine requests are aborted and their
KV blocks freed), then stop the engine loop.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from portlayer.errors import PortlayerError


class ServeError(PortlayerError):
    """The server cannot start as asked (address in use, bad host)."""


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port "
                         "(or stop the process using it)") from None  # fmt: skip
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_server(app: Any, shutdown_timeout: float = 30.0, log_level: str = "warning") -> uvicorn.Server:
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                            lifespan="on", access_log=False, timeout_keep_alive=30)  # fmt: skip
    return uvicorn.Server(config)


def serve_forever(app: Any, host: str, port: int, shutdown_timeout: float = 30.0, log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM (uvicorn's handlers), then shut down gracefully."""
    sock = bind(host, port)
    make_server(app, shutdown_timeout, log_level).run(sockets=[sock])


class ServerThread:
    """The app on 127.0.0.1 (a free port by default) on a background thread: ``with ServerThread(app) as s:``."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0) -> None:
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = make_server(app, shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="portlayer-serve")  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ServeError(f"the server on {self.url} did not start within {timeout:.0f} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
