"""The engine-core process: the model, the scheduler and ``LLMEngine.step``, away from the HTTP side.

Started by ``ProcessEngine`` as a fresh interpreter (spawned, never forked: CUDA cannot be
forked; ``python -m`` of this module, the pipe's file descriptor inherited), it opens the
artifact itself (``LLMEngine.open`` with the server's options), saves the tokenizer where
the API process asked (so the API process never loads weights), says ``ready``, then loops:
run the commands that arrived (add, abort, embed, shutdown; schema-checked JSON,
runtime/serve/ipc.py), step while anything is unfinished, send each step's new token ids,
finish reasons and logprobs plus the engine stats in one message. Stepping never waits for
the API process, whose event loop (SSE, JSON, detokenization) now has a GIL of its own.

The process ignores SIGINT/SIGTERM: Ctrl-C reaches the whole process group, and the API
process decides when to stop (graceful drain, then ``shutdown``). A closed pipe (the API
process died) ends it too, so it never outlives the server.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
import traceback
from typing import Any

from portlayer.runtime.serve import ipc

log = logging.getLogger("portlayer.serve.core")

#: graph-meta keys the API process reads (limits, token ids); the rest stays here
META_KEYS = ("task", "max_positions", "max_seq_length", "vocab_size", "eos_token_id", "source", "model_type")


def engine_stats(engine: Any) -> dict[str, Any]:
    """The numbers /metrics and the tests read, from the engine that owns them."""
    bm, sched = engine.block_manager, engine.scheduler
    return {"running": len(sched.running), "waiting": len(sched.waiting), "free_blocks": bm.num_free_blocks,
            "num_blocks": bm.num_blocks, "unfinished": engine.has_unfinished(), "requests": len(engine.requests),
            "steps": engine.num_steps}  # fmt: skip


def core_main(conn: Any, options_json: str) -> None:
    """The child's entry point: ``options_json`` holds spec, engine kwargs, torch_threads, tokenizer_dir."""
    opts = json.loads(options_json)
    try:
        engine = _open(opts)
    except BaseException as e:  # reported to the API process, which prints it (a user error: no traceback)
        from portlayer.errors import is_user_error

        if not is_user_error(e):
            traceback.print_exc()
        _send(conn, ipc.encode("load_error", message=str(e) or type(e).__name__, kind=type(e).__name__,
                               user_error=is_user_error(e)))  # fmt: skip
        return
    _send(conn, ipc.encode("ready", info=_info(engine)))
    try:
        Core(engine, conn).run()
    except (EOFError, OSError):  # the API process is gone
        pass


def _open(opts: dict[str, Any]) -> Any:
    import torch

    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.serve.logprobs import LogprobSampler

    if opts.get("torch_threads"):
        torch.set_num_threads(int(opts["torch_threads"]))
    engine = LLMEngine.open(opts["spec"], **opts["kwargs"])
    engine.sampler = LogprobSampler(engine.sampler.seed)  # same token choices, plus logprobs on request
    if engine.tokenizer is not None and opts.get("tokenizer_dir"):
        engine.tokenizer.save_pretrained(opts["tokenizer_dir"])
    return engine


def _info(engine: Any) -> dict[str, Any]:
    backend = getattr(engine, "_backend", None)
    meta = {k: engine.meta[k] for k in META_KEYS if k in engine.meta}
    return {"config": dict(vars(engine.config)), "meta": json.loads(json.dumps(meta, default=str)),
            "eos_token_id": engine.eos_token_id, "has_tokenizer": engine.tokenizer is not None,
            "asynchronous": bool(backend is not None and backend.launches_asynchronously()),
            "stats": engine_stats(engine)}  # fmt: skip


def _send(conn: Any, data: bytes) -> None:
    try:
        conn.send_bytes(data)
    except (OSError, ValueError):
        pass


class Core:
    """The loop of the engine-core process (one thread: the engine is not thread-safe)."""

    def __init__(self, engine: Any, conn: Any) -> None:
        self.engine, self.conn = engine, conn
        self.stopping = False

    def run(self) -> None:
        while not self.stopping:
            busy = self.engine.has_unfinished()
            handled = self._commands(block=not busy)
            if self.stopping:
                break
            if not self.engine.has_unfinished():
                if handled:  # e.g. aborts freed the KV cache: /metrics sees it without another step
                    _send(self.conn, ipc.encode("stats", stats=engine_stats(self.engine)))
                continue
            self._step()

    def _commands(self, block: bool) -> int:
        """Run every command that has arrived; wait for one first when idle. Returns how many ran."""
        n = 0
        timeout = 1.0 if block else 0.0
        while self.conn.poll(timeout):
            data = self.conn.recv_bytes()
            try:
                msg = ipc.decode(data, ipc.TO_CORE)
            except ipc.ProtocolError as e:
                log.error("engine core: dropped a message: %s", e)
                continue
            self._handle(msg)
            n += 1
            timeout = 0.0
            if self.stopping:
                break
        return n

    def _handle(self, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "shutdown":
            self._abort(list(self.engine.requests))
            self.stopping = True
        elif kind == "abort":
            self._abort(msg["rids"])
        elif kind == "add":
            self._reply(msg["call"], self._add, msg["reqs"])
        elif kind == "embed":
            self._reply(msg["call"], self._embed, msg["ids"])

    def _reply(self, call: int, fn: Any, *args: Any) -> None:
        from portlayer.runtime.sequence import RequestRejected

        try:
            value, error = fn(*args), None
        except RequestRejected as e:
            value, error = None, {"kind": "rejected", "message": str(e)}
        except ValueError as e:
            value, error = None, {"kind": "value", "message": str(e)}
        except Exception as e:
            log.exception("engine core: %s failed", getattr(fn, "__name__", fn))
            value, error = None, {"kind": "error", "message": f"{type(e).__name__}: {e}"}
        _send(self.conn, ipc.encode("reply", call=call, value=value, error=error))

    def _add(self, reqs: list[dict[str, Any]]) -> None:
        from portlayer.runtime.sequence import SamplingParams

        rids = [r["rid"] for r in reqs]
        try:
            for r in reqs:
                p = r["params"]
                params = SamplingParams(temperature=float(p["temperature"]), top_k=p["top_k"], top_p=float(p["top_p"]),
                                        seed=p["seed"], max_tokens=p["max_tokens"],
                                        stop_token_ids=tuple(p["stop_token_ids"]), ignore_eos=p["ignore_eos"])  # fmt: skip
                if r["logprobs"] is not None:
                    self.engine.sampler.want[r["rid"]] = r["logprobs"]
                self.engine.add_request(r["prompt"], params, request_id=r["rid"])
        except BaseException:  # all or none, as the in-thread engine
            self._abort(rids)
            raise

    def _embed(self, ids: list[list[int]]) -> dict[str, Any]:
        import base64

        emb = self.engine.embed(ids).float().cpu().contiguous()
        return {"shape": list(emb.shape), "f32": base64.b64encode(emb.numpy().astype("<f4").tobytes()).decode()}

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.engine.sampler.forget(rid)
            self.engine.abort_request(rid)

    def _step(self) -> None:
        eng = self.engine
        t0 = time.perf_counter()
        try:
            outs = eng.step()
        except Exception as e:  # a bug or a device error: fail who was in flight, keep serving
            log.exception("engine step failed")
            try:
                self._abort(list(eng.requests))
            except Exception:
                log.exception("aborting after the failed step failed too")
            _send(self.conn, ipc.encode("failed", error=f"engine step failed: {type(e).__name__}: {e}",
                                        stats=engine_stats(eng)))  # fmt: skip
            return
        dt = time.perf_counter() - t0
        sampler, rows = eng.sampler, []
        for o in outs:
            lp = None
            if sampler.want:
                recs = sampler.take(o.request_id)
                lp = [[r.token_id, r.logprob, [list(t) for t in r.top]] for r in recs] if recs else None
            rows.append([o.request_id, list(o.new_token_ids), (o.finish_reason or "stop") if o.finished else None, lp])
            if o.finished:
                sampler.forget(o.request_id)
        if rows:
            _send(self.conn, ipc.encode("step", dt=dt, outs=rows, stats=engine_stats(eng)))


def _ignore_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _watch_parent() -> None:
    """Exit if the API process dies while the engine is still loading (later a closed pipe says so)."""
    import os
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="portlayer-parent-watch", daemon=True).start()


if __name__ == "__main__":  # python -m portlayer.runtime.serve.core_process FD OPTIONS_JSON (ProcessEngine)
    from multiprocessing.connection import Connection

    _ignore_signals()
    _watch_parent()
    core_main(Connection(int(sys.argv[1])), sys.argv[2])
