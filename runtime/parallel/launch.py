"""Opening a tensor-parallel artifact: join or start the group, and give rank 0 its proxy executable.

Under ``torchrun --nproc-per-node N -m portlayer run|serve ART`` every process runs the same
command; rank 0 continues into the engine and the others serve steps until rank 0 stops (then
exit 0). In a plain process rank 0 spawns ranks 1..N-1 itself (torch.multiprocessing, spawn).
"""

from __future__ import annotations

import os
import time
from typing import Any

from portlayer.runtime.parallel.group import (
    ProxyExecutable,
    TensorParallelGroupError,
    Watchdog,
    init_group,
    launched_by_torchrun,
    restore_threads,
    share_cores,
    start_workers,
    torch_backend,
    worker_loop,
)
from portlayer.runtime.parallel.shards import read_shard, world_size

_ACTIVE: dict[str, Any] = {}  # one tensor-parallel group per process: the default process group is global


def rank_executable(loaded: Any, rank: int, world: int) -> tuple[Any, Any, Any]:
    """(this rank's executable on its shard, the control group, its torch device)."""
    import torch

    graph = loaded.graph
    graph.weights = read_shard(loaded.manifest, graph, rank)
    dev = loaded.device
    on_cpu = loaded.interpreted or loaded.emulated  # a GPU / NPU artifact run on this CPU: gloo, no device index
    if dev is not None and dev.torch_device and dev.torch_device != "cpu" and not on_cpu:
        local = int(os.environ.get("LOCAL_RANK", rank))  # one accelerator per rank on this host
        dev.index, dev.torch_device = local, f"{dev.torch_device.split(':')[0]}:{local}"
        if dev.torch_device.startswith("cuda") and torch.cuda.is_available():
            torch.cuda.set_device(local)
    if loaded.torch_device == "cpu":  # ranks on one host's CPU: their share of its cores each
        share_cores(world)
    control = init_group(rank, world, "gloo" if on_cpu else torch_backend(loaded.descriptor))
    loaded.tp_rank = rank
    inner = loaded.executable()
    return inner, control, inner.device


def start_executable(loaded: Any) -> Any:
    """Rank 0's ProxyExecutable (starting the other ranks when no launcher did); workers never return."""
    world = world_size(loaded.plan)
    prev = _ACTIVE.get("proxy")
    if prev is not None and not prev.closed:
        if _ACTIVE.get("path") == str(loaded.path):
            return prev
        raise TensorParallelGroupError(
            f"a tensor-parallel group for {_ACTIVE.get('path')} is still open in this process; close its engine's "
            "executable (executable.close()) before opening another tensor-parallel artifact")
    if launched_by_torchrun():
        rank, have = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if have != world:
            raise TensorParallelGroupError(f"the artifact {loaded.path} was compiled for --tensor-parallel {world} but "
                                           f"torchrun started {have} processes; use torchrun --nproc-per-node {world}")
        inner, control, device = rank_executable(loaded, rank, world)
        if rank != 0:
            import torch.distributed as dist

            worker_loop(inner, control, device)
            dist.destroy_process_group()
            raise SystemExit(0)
        proxy = ProxyExecutable(inner, control, world)
    else:
        procs, addr, port = start_workers(str(loaded.path), world,
                                          {"interpret": loaded.interpreted, "emulate": loaded.emulated})
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
        watchdog = Watchdog(procs)
        watchdog.start()
        try:
            inner, control, _ = rank_executable(loaded, 0, world)
        except Exception as e:  # the rendezvous failed: say which rank, not only what gloo saw
            time.sleep(0.5)
            restore_threads()
            watchdog.handled = watchdog.stopping = True
            watchdog.join_workers(0.5)
            why = watchdog.failure or f"{type(e).__name__}: {str(e)[:300]}"
            raise TensorParallelGroupError(f"the {world} ranks did not start ({why})") from e
        proxy = ProxyExecutable(inner, control, world, watchdog)
    _ACTIVE.update(proxy=proxy, path=str(loaded.path))
    return proxy
