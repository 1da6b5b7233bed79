"""One background task stepping an ``LLMEngine`` while HTTP requests come and go.

The engine is plain synchronous code that is not thread-safe, so every call into it (add,
abort, step, embed) runs on one dedicated engine thread, in submission order: an add or
an abort queued while a step runs takes effect right after that step. The thread steps on
by itself while requests are unfinished (it never waits for the event loop between steps),
and hands each step's outputs to the loop, which stays free to accept and stream while the
model computes. Each HTTP request owns an ``asyncio.Queue``; the loop puts each request's new
tokens (with their logprobs, when asked) on its queue. This is continuous batching across
clients: whatever is in the engine when a step starts shares that step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from portlayer.runtime.sequence import RequestOutput, SamplingParams
from portlayer.runtime.serve.logprobs import LogprobSampler, TokenLogprob

log = logging.getLogger("portlayer.serve")


class EngineOverloaded(Exception):
    """More requests in flight than the server admits (``max_num_seqs + max_queue_len``)."""


class EngineFailed(Exception):
    """A step raised; every request in flight at that moment is failed with this."""


@dataclass(frozen=True)
class Submission:
    prompt_token_ids: list[int]
    params: SamplingParams
    logprobs: int | None = None  # top-k alternatives to record per token (0 = the chosen one only)


@dataclass
class StepItem:
    """What one step produced for one request."""

    output: RequestOutput
    logprobs: list[TokenLogprob]
    time: float  # perf_counter() when the step ended


class StreamDelivery:
    """What both engine cores (this thread, runtime/serve/process_engine.py's process) do on the event loop:
    hand each request's step items to its ``asyncio.Queue``, or fail every queue. Subclasses set
    ``self._loop`` and ``self._queues``."""

    _loop: asyncio.AbstractEventLoop | None
    _queues: dict[str, asyncio.Queue]
    _ids: Iterator[int]
    max_in_flight: int

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def _admit(self, subs: Sequence[Submission], queue: asyncio.Queue,
                     add: Callable[[list[str]], Awaitable[Any]]) -> list[str]:
        """Name ``subs``, register their queue, and ``add`` them to the engine: all or none."""
        if len(self._queues) + len(subs) > self.max_in_flight:
            raise EngineOverloaded(f"{len(self._queues)} requests in flight; this server admits {self.max_in_flight} "
                                   "(--max-num-seqs + --max-queue-len); retry later")  # fmt: skip
        rids = [f"req-{next(self._ids)}" for _ in subs]
        for rid in rids:  # registered before the add, so no step's output can be missed
            self._queues[rid] = queue
        try:
            await add(rids)
        except BaseException:
            for rid in rids:
                self._queues.pop(rid, None)
            raise
        return rids

    def _to_loop(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    def _deliver(self, items: list[StepItem]) -> None:
        """On the event loop: each request's new tokens onto its queue."""
        for it in items:
            rid = it.output.request_id
            q = self._queues.get(rid)
            if q is None:
                continue  # aborted while the step ran
            if it.output.finished:
                del self._queues[rid]
            q.put_nowait(it)

    def _fail_queues(self, err: EngineFailed) -> None:
        """On the event loop: every request in flight ends with ``err``."""
        rids = list(self._queues)
        if rids:
            log.error("%s; failing %d requests", err, len(rids))
        for rid in rids:
            self._queues.pop(rid).put_nowait(err)


class AsyncEngine(StreamDelivery):
    def __init__(self, engine: Any, max_queue_len: int = 1024, step_observer: Any = None) -> None:
        self.engine = engine
        if type(engine.sampler) is not LogprobSampler:  # same token choices, plus logprobs on request
            engine.sampler = LogprobSampler(engine.sampler.seed)
        self.max_in_flight = engine.config.max_num_seqs + max(0, max_queue_len)
        self.step_observer = step_observer  # called with (seconds, num_outputs) on the worker thread
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()  # (fn, args, future) for the engine thread
        self._queues: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    # ---- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._engine_thread, name="portlayer-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    async def shutdown(self) -> None:
        """Abort whatever is still in flight (uvicorn has already let finished requests drain)."""
        if self._thread is None:
            return
        rids = list(self._queues)
        if rids and self._thread.is_alive():
            await self._call(self._abort_all, rids)
        for q in self._queues.values():
            q.put_nowait(EngineFailed("the server is shutting down; the request was aborted"))
        self._queues.clear()
        self._stopping = True
        self._cmds.put(None)  # wakes the thread, which then ends
        await asyncio.to_thread(self._thread.join)

    # ---- requests ------------------------------------------------------------------
    async def submit(self, subs: Sequence[Submission], queue: asyncio.Queue) -> list[str]:
        """Queue these engine requests (all or none); their StepItems arrive on ``queue``.

        Raises EngineOverloaded, or RequestRejected / ValueError from the engine (nothing queued)."""
        if self._stopping or not self.alive:
            raise EngineFailed("the engine loop is not running")
        return await self._admit(subs, queue, lambda rids: self._call(self._add_all, rids, subs))

    def abort(self, rids: Sequence[str]) -> None:
        """Stop these requests (a client went away, or a stop string matched); frees their KV blocks."""
        live = [r for r in rids if self._queues.pop(r, None) is not None]
        if live and not self._stopping:
            self._cmds.put((self._abort_all, (live,), None))

    def engine_stats(self) -> dict[str, Any]:
        """Scheduler and KV numbers for /metrics (read from the event loop; plain list lengths)."""
        from portlayer.runtime.serve.core_process import engine_stats

        return engine_stats(self.engine)

    async def embed(self, token_lists: list[list[int]]) -> torch.Tensor:
        return await self._call(self.engine.embed, token_lists)

    # ---- the engine thread ----------------------------------------------------------
    async def _call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the engine thread (between two steps); its result or exception."""
        if self._thread is None or not self._thread.is_alive():
            raise EngineFailed("the engine loop is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((fn, args, fut))
        return await asyncio.wrap_future(fut)

    def _engine_thread(self) -> None:
        """Run queued calls, step while anything is unfinished, hand the outputs to the event loop."""
        while True:
            try:  # block only when there is nothing to step
                cmd = self._cmds.get(block=not self.engine.has_unfinished())
            except queue.Empty:
                cmd = ()
            while cmd != ():
                if cmd is None:
                    return
                fn, args, fut = cmd
                try:
                    result = fn(*args)
                    if fut is not None:
                        fut.set_result(result)
                except BaseException as e:  # the caller (or the log, for fire-and-forget aborts) gets it
                    if fut is not None:
                        fut.set_exception(e)
                    else:
                        log.exception("engine call %s failed", getattr(fn, "__name__", fn))
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = ()
            try:
                items = self._step()
            except Exception as e:  # a bug or a device error: fail who was in flight, keep serving
                log.exception("engine step failed")
                try:
                    self._abort_all(list(self.engine.requests))
                except Exception:
                    log.exception("aborting after the failed step failed too")
                self._to_loop(self._fail_all, e)
                continue
            if items:
                self._to_loop(self._deliver, items)

    def _fail_all(self, e: BaseException) -> None:
        """On the event loop: every request in flight when a step raised ends with that error."""
        self._fail_queues(EngineFailed(f"engine step failed: {type(e).__name__}: {e}"))

    def _add_all(self, rids: list[str], subs: Sequence[Submission]) -> None:
        try:
            for rid, s in zip(rids, subs):
                if s.logprobs is not None:
                    self.engine.sampler.want[rid] = s.logprobs
                self.engine.add_request(s.prompt_token_ids, s.params, request_id=rid)
        except BaseException:  # all or none: undo the ones already queued
            self._abort_all(rids)
            raise

    def _abort_all(self, rids: Sequence[str]) -> None:
        for rid in rids:
            self.engine.sampler.forget(rid)
            self.engine.abort_request(rid)

    def _step(self) -> list[StepItem] | None:
        if not self.engine.has_unfinished():
            return None
        t0 = time.perf_counter()
        outs = self.engine.step()
        t1 = time.perf_counter()
        sampler = self.engine.sampler
        items = [StepItem(o, sampler.take(o.request_id) if sampler.want else [], t1) for o in outs]
        for o in outs:
            if o.finished:
                sampler.forget(o.request_id)
        if self.step_observer is not None:
            self.step_observer(t1 - t0, len(outs))
        return items

