"""The API side of the engine-core process: ``AsyncEngine``'s interface over a pipe.

``ProcessEngine(spec, kwargs)`` spawns runtime/serve/core_process.py, waits until it has
loaded the artifact (its load errors become an ``EngineStartError`` with the child's message), and
loads the tokenizer the child saved, so this process holds no weights. Afterwards the event
loop only sends commands (add, abort, embed; a writer thread does the blocking
writes) and a reader thread turns each step message into ``StepItem``s on the requests'
queues. Detokenization and stop strings stay here (generation.py, ``TextStream``), as in
thread mode; a stop string aborts the request in the child, which frees its KV blocks.

If the child dies, every request in flight fails with ``EngineFailed`` (HTTP 500 / a stream
error event), new ones get 503 and ``alive`` (``/health``) turns false.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import concurrent.futures
import itertools
import json
import logging
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from portlayer.errors import PortlayerError
from portlayer.runtime.sequence import RequestOutput, RequestRejected
from portlayer.runtime.serve import ipc
from portlayer.runtime.serve.async_engine import (
    EngineFailed,
    StepItem,
    StreamDelivery,
    Submission,
)
from portlayer.runtime.serve.logprobs import TokenLogprob

log = logging.getLogger("portlayer.serve")


class EngineStartError(PortlayerError):
    """The engine-core process could not load the artifact (the message says why)."""


@dataclass
class EngineView:
    """What the HTTP side reads of the engine (sizes, limits, tokenizer) without holding it."""

    config: Any  # EngineConfig
    meta: dict[str, Any]
    eos_token_id: int | None
    tokenizer: Any


class ProcessEngine(StreamDelivery):
    """An ``LLMEngine`` in a spawned child process, driven like ``AsyncEngine``."""

    def __init__(self, spec: str, engine_kwargs: dict[str, Any], *, max_queue_len: int = 1024,
                 torch_threads: int | None = None, ready_timeout: float | None = None) -> None:  # fmt: skip
        from portlayer.runtime.engine import EngineConfig

        self.spec = str(spec)
        self.step_observer: Any = None  # called with (seconds, num_outputs) on the reader thread
        self._queues: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids, self._ids = itertools.count(), itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._stopping = self._dead = False
        self._lock = threading.Lock()
        tok_dir = tempfile.mkdtemp(prefix="portlayer-serve-tok-")
        opts = {"spec": self.spec, "kwargs": engine_kwargs, "torch_threads": torch_threads, "tokenizer_dir": tok_dir}
        ours, theirs = socket.socketpair()
        # a fresh interpreter (spawn: CUDA cannot be forked), which never re-runs the caller's __main__
        cmd = [sys.executable, "-m", "portlayer.runtime.serve.core_process", str(theirs.fileno()), json.dumps(opts)]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            shutil.rmtree(tok_dir, ignore_errors=True)
            raise
        finally:
            theirs.close()  # closed here: the child's death is an EOF on our end
        self._conn = Connection(ours.detach())
        try:
            atexit.register(self.close)
            info = self._wait_ready(ready_timeout)
            self.info = info
            tok = None
            if info.get("has_tokenizer"):
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(tok_dir)
        except BaseException:
            self.close()
            raise
        finally:
            shutil.rmtree(tok_dir, ignore_errors=True)
        self.view = EngineView(EngineConfig(**info["config"]), dict(info["meta"]), info.get("eos_token_id"), tok)
        self._stats: dict[str, Any] = dict(info["stats"])
        self.max_in_flight = self.view.config.max_num_seqs + max(0, max_queue_len)

    def _wait_ready(self, timeout: float | None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if self.proc.poll() is not None:
                if self._conn.poll(0):  # it said why before it went
                    break
                raise EngineStartError(f"the engine process exited with status {self.proc.returncode} while "
                                       f"loading {self.spec}; its output is above")  # fmt: skip
            if deadline is not None and time.monotonic() > deadline:
                raise EngineStartError(f"the engine process did not load {self.spec} within {timeout:.0f} s")
        try:
            msg = ipc.decode(self._conn.recv_bytes(), ipc.FROM_CORE)
        except (EOFError, OSError):
            self.proc.wait()
            raise EngineStartError(f"the engine process exited with status {self.proc.returncode} while loading "
                                   f"{self.spec}; its output is above") from None  # fmt: skip
        if msg["t"] == "load_error":
            if msg["user_error"]:
                raise EngineStartError(msg["message"])
            raise RuntimeError(f"the engine process failed to load {self.spec}: {msg['kind']}: {msg['message']} "
                               "(traceback above)")  # fmt: skip
        if msg["t"] != "ready":
            raise EngineStartError(f"the engine process sent {msg['t']!r} before it was ready")
        return msg["info"]

    # ---- lifecycle (AsyncEngine's interface) ----------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for target, name in ((self._reader, "portlayer-core-reader"), (self._writer, "portlayer-core-writer")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    @property
    def alive(self) -> bool:
        return not self._dead and not self._stopping and self.proc.poll() is None

    async def shutdown(self) -> None:
        """Abort what is still in flight, stop the child, wait for it (uvicorn has drained already)."""
        rids = list(self._queues)
        if rids:
            self.abort(rids)
        for q in self._queues.values():
            q.put_nowait(EngineFailed("the server is shutting down; the request was aborted"))
        self._queues.clear()
        await asyncio.to_thread(self.close)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child (a ``shutdown`` message, then SIGKILL after ``timeout``); idempotent."""
        with self._lock:
            if self._stopping and self.proc.poll() is not None:
                return
            self._stopping = True
        if self.proc.poll() is None and not hasattr(self, "info"):  # still loading (Ctrl-C, a timeout): nothing to drain
            self.proc.kill()
            self.proc.wait()
        if self.proc.poll() is None:
            if any(t.is_alive() for t in self._threads):  # one writer on the pipe: no interleaved frames
                self._out.put(ipc.encode("shutdown"))
            else:
                try:
                    self._conn.send_bytes(ipc.encode("shutdown"))
                except (OSError, ValueError):
                    pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the engine process did not stop in %.0f s; killing it", timeout)
                self.proc.kill()
                self.proc.wait(10)
        self._out.put(None)
        for t in self._threads:  # the reader has seen the EOF, the writer its None: then our end can close
            if t is not threading.current_thread():
                t.join(5)
        try:
            self._conn.close()
        except OSError:
            pass
        atexit.unregister(self.close)

    # ---- requests ---------------------------------------------------------------------
    def engine_stats(self) -> dict[str, Any]:
        """The child's latest stats (sent with every step, and after commands when idle)."""
        return self._stats

    async def submit(self, subs: Sequence[Submission], queue: asyncio.Queue) -> list[str]:
        if not self.alive:
            raise EngineFailed(self._why_dead())
        def add(rids: list[str]) -> Any:
            return self._call("add", reqs=[{"rid": rid, "prompt": [int(t) for t in s.prompt_token_ids],
                                            "params": _params(s.params), "logprobs": s.logprobs}
                                           for rid, s in zip(rids, subs)])

        return await self._admit(subs, queue, add)

    def abort(self, rids: Sequence[str]) -> None:
        live = [r for r in rids if self._queues.pop(r, None) is not None]
        if live and not self._dead:
            self._out.put(ipc.encode("abort", rids=live))

    async def embed(self, token_lists: list[list[int]]) -> Any:
        import numpy as np
        import torch

        v = await self._call("embed", ids=[[int(t) for t in x] for x in token_lists])
        arr = np.frombuffer(base64.b64decode(v["f32"]), dtype="<f4").reshape(v["shape"])
        return torch.from_numpy(arr.copy())

    async def _call(self, kind: str, **fields: Any) -> Any:
        if self._dead or self._loop is None:
            raise EngineFailed(self._why_dead())
        call = next(self._call_ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[call] = fut
        self._out.put(ipc.encode(kind, call=call, **fields))
        return await asyncio.wrap_future(fut)

    def _why_dead(self) -> str:
        if self._stopping:
            return "the server is shutting down"
        code = self.proc.poll()
        return f"the engine process is not running (exit status {code}); restart the server" if code is not None \
            else "the engine process is not running; restart the server"  # fmt: skip

    # ---- threads ----------------------------------------------------------------------
    def _writer(self) -> None:
        while (data := self._out.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError):
                return  # the reader sees the pipe close and fails what was in flight

    def _reader(self) -> None:
        try:
            while True:
                msg = ipc.decode(self._conn.recv_bytes(), ipc.FROM_CORE)
                self._on_message(msg, time.perf_counter())
        except (EOFError, OSError, ValueError):
            pass
        except ipc.ProtocolError as e:
            log.error("the engine process sent a bad message (%s); treating it as dead", e)
        self._on_dead()

    def _on_message(self, msg: dict[str, Any], now: float) -> None:
        kind = msg["t"]
        if "stats" in msg:
            self._stats = msg["stats"]
        if kind == "reply":
            fut = self._calls.pop(msg["call"], None)
            if fut is None:
                return
            err = msg["error"]
            if err is None:
                fut.set_result(msg.get("value"))
            else:
                exc = {"rejected": RequestRejected, "value": ValueError}.get(err.get("kind"), RuntimeError)
                fut.set_exception(exc(str(err.get("message"))))
        elif kind == "step":
            items = [StepItem(RequestOutput(rid, [], None, ids, reason is not None, reason), _records(lp), now)
                     for rid, ids, reason, lp in msg["outs"]]  # fmt: skip
            if self.step_observer is not None:
                self.step_observer(float(msg["dt"]), len(items))
            self._to_loop(self._deliver, items)
        elif kind == "failed":
            self._to_loop(self._fail_all, EngineFailed(msg["error"]))

    def _on_dead(self) -> None:
        self._dead = True
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        why = "the server is shutting down" if self._stopping else f"the engine process exited (status {code})"
        if not self._stopping:
            log.error("%s; failing the requests in flight", why)
        for call in list(self._calls):
            fut = self._calls.pop(call, None)
            if fut is not None and not fut.done():
                fut.set_exception(EngineFailed(why))
        self._to_loop(self._fail_all, EngineFailed(why))

    def _fail_all(self, e: BaseException) -> None:
        self._fail_queues(e if isinstance(e, EngineFailed) else EngineFailed(str(e)))


def default_engine_core(spec: str, device: str = "cpu") -> str:
    """'process' where the artifact's backend launches asynchronously (its steps then overlap with host work
    that would otherwise share one GIL with HTTP), else 'thread'. Asks the backend adapter; loads nothing."""
    from pathlib import Path

    from portlayer.backends.registry import backend_class
    from portlayer.runtime.artifact import MANIFEST

    manifest = Path(spec) / MANIFEST
    try:
        if manifest.is_file():
            target = json.loads(manifest.read_text())["target"]
            device_type = str(target.get("backend") or target["device_type"])
        else:
            import torch

            device_type = torch.device(device).type
        return "process" if backend_class(device_type)(None, 0).launches_asynchronously() else "thread"
    except (OSError, ValueError, KeyError, TypeError, RuntimeError):
        return "thread"  # an unreadable artifact: the load reports it


def _params(p: Any) -> dict[str, Any]:
    return {"temperature": float(p.temperature), "top_k": int(p.top_k), "top_p": float(p.top_p), "seed": p.seed,
            "max_tokens": int(p.max_tokens), "stop_token_ids": [int(t) for t in p.stop_token_ids],
            "ignore_eos": bool(p.ignore_eos)}  # fmt: skip


def _records(lp: list[Any] | None) -> list[TokenLogprob]:
    if not lp:
        return []
    return [TokenLogprob(int(t), float(v), tuple((int(a), float(b)) for a, b in top)) for t, v, top in lp]
