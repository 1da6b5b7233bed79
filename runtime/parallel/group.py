"""The tensor-parallel group: rank 0 runs the engine, ranks 1..N-1 execute the same step on their shard.

Rank 0's engine gets a :class:`ProxyExecutable`. Each ``run`` first broadcasts the step (feeds,
attention metadata, the KV-cache shapes) to the workers over a gloo control group, then runs
rank 0's own program; the collectives inside the program (all_reduce / all_gather on the default
group, the descriptor's library) keep the ranks in lock step, and rank 0's result is returned.
The engine, scheduler and sampler are unchanged: they never know there is more than one rank.

Ranks come from ``torchrun`` (its RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT are honoured) or,
in a plain process, from :func:`start_workers` (torch.multiprocessing, spawn). A rank that dies
fails the group: the collectives have a timeout, a watchdog on rank 0 notices a dead worker
process at once, and the error (:class:`TensorParallelGroupError`, a SystemExit so the per-request
failure isolation of the engine does not retry it) names the rank and its exit code.

The step broadcast pickles plain tensors and the metadata dataclass between the group's own
processes (torch.distributed.broadcast_object_list); nothing from an artifact or a request is
unpickled there.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

#: seconds a collective waits for the other ranks before the group fails (PORTLAYER_TP_TIMEOUT)
DEFAULT_TIMEOUT_S = 30.0
#: seconds the watchdog leaves rank 0 to raise by itself before it exits the process
WATCHDOG_GRACE_S = 3.0


class TensorParallelGroupError(SystemExit):
    """The tensor-parallel group failed (a rank died or timed out); the whole group stops.

    A SystemExit on purpose: it must not be caught as one request's failure by the engine's step
    guard, and `portlayer run|serve` print its message and exit 1 without a traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(f"portlayer: tensor-parallel group failed: {message}")
        self.message = message


def timeout_s() -> float:
    try:
        return float(os.environ.get("PORTLAYER_TP_TIMEOUT", DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def torch_backend(descriptor: Any) -> str:
    coll = descriptor.raw.get("collectives") or {}
    return str(coll.get("torch_backend") or "gloo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init_group(rank: int, world: int, backend: str) -> Any:
    """The default process group (collectives of the program) and a gloo control group (step broadcast,
    no timeout worth speaking of: a worker waits there while rank 0 is idle)."""
    import torch.distributed as dist

    if dist.is_initialized() and not launched_by_torchrun():
        raise TensorParallelGroupError("this process already belongs to a torch.distributed process group; close "
                                       "the previous tensor-parallel executable (executable.close()) first")
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s()))
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))


# ---- step messages ---------------------------------------------------------------------------------
def _to(x: Any, device: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _to(getattr(x, f.name), device) for f in dataclasses.fields(x)})
    return x


def _kv_layout(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None) -> Any:
    if kv_caches is None:
        return None
    return [tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in pair) for pair in kv_caches]


class ProxyExecutable:
    """Rank 0's Executable: broadcasts each step to the workers, runs its own shard, returns its result."""

    def __init__(self, inner: Any, control: Any, world: int, watchdog: Watchdog | None = None) -> None:
        self.inner, self.control, self.world, self.watchdog = inner, control, world, watchdog
        self.device, self.dtype, self.input_names = inner.device, inner.dtype, inner.input_names
        self.kv_dtype = getattr(inner, "kv_dtype", None)
        self.closed = False
        self.in_step = False
        if watchdog is not None:
            watchdog.busy = lambda: self.in_step
        atexit.register(self.close)

    def __getattr__(self, name: str) -> Any:  # anything else an executable offers (e.g. graph) is rank 0's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _send(self, message: Any) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([message], src=0, group=self.control)

    def run(self, feeds: Mapping[str, torch.Tensor], attn_metadata: Any, kv_caches: Any) -> list[torch.Tensor]:
        if self.closed:
            raise TensorParallelGroupError("the group was closed; open the artifact again")
        if kv_caches and self.kv_dtype is not None and kv_caches[0][0].dtype != self.kv_dtype:
            # refused before the broadcast: the workers would allocate the same caches and fail with it
            raise TypeError(f"tensor-parallel program: KV caches of {kv_caches[0][0].dtype}, its attention reads "
                            f"{self.kv_dtype} caches; allocate them with portlayer.codegen.host_support.kv_cache_dtype")
        self._check()
        self.in_step = True
        try:
            step = ({k: v.cpu() for k, v in feeds.items()}, _to(attn_metadata, "cpu"), _kv_layout(kv_caches))
            self._send(("step", step))
            return self.inner.run(feeds, attn_metadata, kv_caches)
        except TensorParallelGroupError:
            raise
        except Exception as e:
            time.sleep(0.3)  # let the watchdog name the rank that died
            self._check()
            if _is_comm_error(e):
                _fail(f"a collective failed on rank 0 ({type(e).__name__}: {str(e)[:300]})")
            raise
        finally:
            self.in_step = False

    def _check(self) -> None:
        if self.watchdog is not None and self.watchdog.failure:
            self.watchdog.handled = True
            _fail(self.watchdog.failure)

    def close(self) -> None:
        """Tell the workers to exit, then leave the group (atexit does it too)."""
        if self.closed:
            return
        self.closed = True
        if self.watchdog is not None:
            self.watchdog.stopping = True
        try:
            if not (self.watchdog and self.watchdog.failure):
                self._send(("stop", None))
        except Exception:  # a dead group: nothing left to tell
            pass
        failed = bool(self.watchdog and self.watchdog.failure)
        if self.watchdog is not None:
            self.watchdog.join_workers(0.5 if failed else 5.0)
        try:
            import torch.distributed as dist

            if dist.is_initialized():  # also after a failure: the next group of this process needs a fresh start
                dist.destroy_process_group()
        except Exception:  # leaving a failed group
            pass
        restore_threads()


def _fail(message: str) -> None:
    """Raise the group error; under `portlayer run|serve` (PORTLAYER_TP_EXIT_ON_FAILURE=1) exit at once instead,
    since tearing down torch and a broken gloo group can take seconds on a busy host."""
    err = TensorParallelGroupError(message)
    if os.environ.get("PORTLAYER_TP_EXIT_ON_FAILURE") == "1":
        sys.stdout.flush()
        print(err.code, file=sys.stderr, flush=True)
        os._exit(1)
    raise err


def _is_comm_error(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return any(w in text for w in ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "collective",
                                   "distbackenderror", "disterror"))


def worker_loop(inner: Any, control: Any, device: Any) -> None:
    """Ranks 1..N-1: run every step rank 0 broadcasts, on this rank's shard and KV cache, until 'stop'."""
    import torch.distributed as dist

    caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    layout: Any = None
    while True:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=control)
        except Exception as e:  # rank 0 is gone (stopped by a signal, or failed): its own exit says why
            if not _is_comm_error(e):
                raise
            _leave_quietly(f"rank 0 left the group ({str(e).splitlines()[0][:160]})")
        kind, payload = box[0]
        if kind == "stop":
            return
        feeds, meta, want = payload
        if want != layout:
            caches = None if want is None else [
                tuple(torch.zeros(shape, dtype=getattr(torch, dt), device=device) for shape, dt in pair) for pair in want]
            layout = want
        try:
            inner.run({k: v.to(device) for k, v in feeds.items()}, _to(meta, device), caches)
        except Exception as e:
            if not _is_comm_error(e):
                raise
            _leave_quietly(f"a collective failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})")


def _leave_quietly(why: str) -> None:
    """A worker whose group broke: one line, no traceback, exit 0 (the rank that failed reports the error)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else "?"
    print(f"portlayer: tensor-parallel rank {rank} stops: {why}", file=sys.stderr, flush=True)
    os._exit(0)


# ---- launching ranks from a plain process ----------------------------------------------------------------
class Watchdog(threading.Thread):
    """Rank 0's eye on its worker processes: a dead one fails the group within a fraction of a second
    (rank 0 raises at its next step, or its collective fails); if rank 0 stays stuck inside a step,
    the process exits after a grace period instead of waiting for the collective timeout."""

    def __init__(self, procs: list[Any]) -> None:
        super().__init__(name="portlayer-tp-watchdog", daemon=True)
        self.procs, self.failure, self.handled, self.stopping = procs, "", False, False
        self.busy: Any = lambda: False  # the proxy reports whether rank 0 is inside a step

    def run(self) -> None:
        while not self.stopping:
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None and not self.stopping:
                    self.failure = (f"rank {rank} (pid {p.pid}) exited with code {p.exitcode} "
                                    f"({'killed by signal ' + str(-p.exitcode) if p.exitcode < 0 else 'error'}); "
                                    "the other ranks are stopped")
                    self._terminate()
                    self._settle()
                    return
            time.sleep(0.1)

    def _settle(self) -> None:
        """After a failure: leave it to rank 0 once it raised (a library caller decides), but exit the
        process if rank 0 stays stuck in a step past the grace, or at once past it under `portlayer serve`."""
        hard = os.environ.get("PORTLAYER_TP_EXIT_ON_FAILURE") == "1"
        deadline = time.monotonic() + WATCHDOG_GRACE_S
        while not self.stopping:
            if self.handled and not hard:
                return
            if time.monotonic() >= deadline and (hard or self.busy()):
                print(f"portlayer: tensor-parallel group failed: {self.failure}", file=sys.stderr, flush=True)
                os._exit(1)
            time.sleep(0.05)

    def _terminate(self) -> None:
        for p in self.procs:
            if p.exitcode is None:
                p.kill()

    def join_workers(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()


def _worker_main(path: str, rank: int, world: int, addr: str, port: int, options: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), PORTLAYER_TP_SPAWNED="1")
    parent = os.getppid()

    def orphan_guard() -> None:  # rank 0 died without a word: never outlive it
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=orphan_guard, daemon=True).start()
    from portlayer.runtime.loaded import open_artifact
    from portlayer.runtime.parallel.launch import rank_executable

    loaded = open_artifact(path, interpret=bool(options.get("interpret")), emulate=bool(options.get("emulate")))
    inner, control, device = rank_executable(loaded, rank, world)
    worker_loop(inner, control, device)
    import torch.distributed as dist

    dist.destroy_process_group()


_THREADS_BEFORE: dict[str, int] = {}  # the process's own thread count, restored when its group closes


def share_cores(world: int) -> None:
    """N ranks on one CPU: each rank's intra-op threads get its share of the cores (as vLLM's CPU workers
    do), not all of them, which would oversubscribe the host N-fold. PORTLAYER_TP_THREADS overrides."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    want = os.environ.get("PORTLAYER_TP_THREADS")
    _THREADS_BEFORE.setdefault("n", torch.get_num_threads())
    torch.set_num_threads(int(want) if want and want.isdigit() and int(want) > 0 else max(1, cores // world))


def restore_threads() -> None:
    """Give this process back the intra-op thread count it had before :func:`share_cores`."""
    if "n" in _THREADS_BEFORE:
        torch.set_num_threads(_THREADS_BEFORE.pop("n"))


def start_workers(path: str, world: int, options: Mapping[str, Any]) -> tuple[list[Any], str, int]:
    import torch.multiprocessing as mp

    addr, port = "127.0.0.1", _free_port()
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world):
        p = ctx.Process(target=_worker_main, args=(path, rank, world, addr, port, dict(options)), daemon=True,
                        name=f"portlayer-tp-rank{rank}")
        p.start()
        procs.append(p)
    return procs, addr, port
