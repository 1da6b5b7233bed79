"""Weights onto an accelerator through pinned staging buffers, several copies in flight.

``tensor.to("cuda")`` from a memory-mapped (pageable) tensor copies one tensor at a time through
the driver's own small bounce buffer: 2-3 GB/s on the H200 host, so an 8B model (16 GB) spent
most of its 6-8 s load there. Here a few threads each own a pinned buffer and a stream: a thread
copies a piece of a tensor into its buffer (page-cache reads run in parallel, torch's copy
releases the GIL) and queues the host-to-device copy on its stream, then waits for that copy
only before it reuses the buffer. Small tensors go the plain way (the staging would cost more
than it saves). CPU targets and devices without streams take the plain path.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from portlayer.config import positive_int_env

STAGE_BYTES = 64 << 20  # one pinned buffer per thread; pieces of a tensor are at most this big
SMALL_BYTES = 1 << 20  # below this a tensor is copied directly
DEFAULT_THREADS = 4


@dataclass
class _Stage:
    """One thread's pinned buffer, its stream, and the event of the copy that last read the buffer."""

    buffer: torch.Tensor
    stream: Any
    event: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def _threads() -> int:
    return positive_int_env("PORTLAYER_UPLOAD_THREADS", DEFAULT_THREADS, "threads copying weights to the device")


def _device_module(device: torch.device) -> Any:
    """torch.cuda / torch.xpu ...: the device's module when it has streams and events, else None."""
    mod = getattr(torch, device.type, None)
    if device.type == "cpu" or mod is None or not all(hasattr(mod, a) for a in ("Stream", "Event", "stream")):
        return None
    return mod


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def upload(weights: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype], device: torch.device | str,
           threads: int | None = None) -> dict[str, torch.Tensor]:
    """``{name: weights[name].to(device, dtypes[name])}`` for every name of ``dtypes``, staged (see the module).

    The values equal the plain ``.to``'s bit for bit: the bytes are copied as stored, and a dtype change
    (rare: the layout normally keeps the stored dtype) happens on the device afterwards. Returns once every
    copy has completed."""
    device = torch.device(device)
    mod = _device_module(device)
    n = threads or _threads()
    big = [k for k in dtypes if weights[k].nbytes >= SMALL_BYTES and weights[k].is_contiguous()
           and weights[k].device.type == "cpu"]
    if mod is None or n <= 1 or not big:
        return {k: weights[k].to(device=device, dtype=dtypes[k]) for k in dtypes}
    out: dict[str, torch.Tensor] = {}
    with mod.device(device):
        stages = [_Stage(_pinned(STAGE_BYTES), mod.Stream())
                  for _ in range(min(n, len(big)))]
        raw = {k: torch.empty(weights[k].shape, dtype=weights[k].dtype, device=device) for k in big}
        pieces = [(k, off) for k in big for off in range(0, weights[k].nbytes, STAGE_BYTES)]

        def copy(i: int) -> None:
            k, off = pieces[i]
            stage = stages[i % len(stages)]
            src = weights[k].reshape(-1).view(torch.uint8)
            dst = raw[k].reshape(-1).view(torch.uint8)
            m = min(STAGE_BYTES, src.numel() - off)
            with stage.lock:
                if stage.event is not None:
                    stage.event.synchronize()  # the previous piece left this buffer
                stage.buffer[:m].copy_(src[off:off + m])
                with mod.stream(stage.stream):
                    dst[off:off + m].copy_(stage.buffer[:m], non_blocking=True)
                    stage.event = mod.Event()
                    stage.event.record(stage.stream)

        with ThreadPoolExecutor(len(stages), thread_name_prefix="portlayer-upload") as pool:
            list(pool.map(copy, range(len(pieces))))  # re-raises a failed copy here
        for stage in stages:
            stage.stream.synchronize()
        for k in dtypes:
            out[k] = raw[k].to(dtypes[k]) if k in raw else weights[k].to(device=device, dtype=dtypes[k])
    return out
