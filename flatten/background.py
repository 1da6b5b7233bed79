"""Work in a daemon helper thread, its result or error handed back through a Future.

A compile overlaps independent work (the model digest with the capture, the weights' write with codegen, the
validation set with both): each runs ``fn`` in a thread of its own and the caller waits on ``result()``, which
re-raises what ``fn`` raised. Daemon threads: a caller that fails does not wait at exit for work it abandoned
(torch and hashlib release the GIL, so the threads run beside the caller's Python).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def in_thread(fn: Callable[[], T], name: str) -> Future[T]:
    """Start ``fn()`` in a daemon thread called ``name``; the Future holds its return value or its exception."""
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the Future
            done.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done
