"""Timing and progress for the calibration micro-benchmarks.

Every benchmark times the same way and announces itself on stderr, so a user sees what runs
and how long each part takes. Device events on a GPU; on the CPU the process's CPU time when
torch runs one thread (time the host gave to other processes does not count: on a shared host
the wall clock measures the neighbours) and the wall clock otherwise. Interference only ever
slows a run down, so the number kept is the median of the fastest half of many short
repetitions (``trimmed``), after a warm-up.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import torch

SIGNIFICANT = 4  # measurements keep 4 significant digits: a slow dtype is never rounded to 0


def sig(x: float, digits: int = SIGNIFICANT) -> float:
    """``x`` to ``digits`` significant digits; positive stays positive (round(x, 3) made 0.0004 TFLOP/s 0.0)."""
    return float(f"{x:.{digits}g}")


@dataclass(frozen=True)
class Sizes:
    """How hard each benchmark pushes; ``quick`` presets keep the whole run inside its budget."""

    copy_bytes: int  # largest buffer of the bandwidth sweep
    matmul_n: int  # n of the n^3 matmul per dtype
    iters: int
    warmup: int
    launches: int
    max_seconds_per_dtype: float
    reps: int = 3  # repetitions; the median of the fastest half is kept (``trimmed``)
    budget_s: float = 0.1  # time one measurement may take (its reps share it)
    rounds: int = 1  # the whole suite this many times, the median per number (calibrate_rounds.py)
    gemm_k: int = 1024  # K = N of the small-M (decode) GEMM curve
    gemm_ms: tuple[int, ...] = (1, 4, 16, 64, 256)
    attn_points: tuple[tuple[int, int], ...] = ((1, 256), (8, 256))  # (batch, context) of the paged read
    attn_heads: tuple[int, int, int] = (8, 2, 64)  # q heads, kv heads, head dim
    # the decode GEMM curves cycle through weight copies of at least this many bytes (0: one weight), so each
    # call reads its weight from memory as a decode step does (every other layer's weights stream between
    # two reads of one), not from a cache that a small repeated weight stays in (the H200's L2 is 50 MB)
    cold_bytes: int = 0
    # ... for weights of at least this many bytes (a smaller one, the small-K curve's fixed cost, stays one weight:
    # on a CPU a model's small weights stay in the caches between steps, its large ones stream from memory)
    cold_min_bytes: int = 0


# CPU decode GEMM curves read cold weights (cold_bytes): on this 2-vCPU host F.linear at one row reads a 4-24 MiB
# weight at 27-28 GB/s when it is the same weight each call and at 16-18 GB/s cycling through 256 MiB of them, as
# a decode step does (2026-12-04, docs/capabilities.md session 16; the hot curve predicted the 0.6B shape 21-33% low)
CPU_QUICK = Sizes(copy_bytes=64 * 2**20, matmul_n=512, iters=5, warmup=3, launches=20000, max_seconds_per_dtype=0.25,
                  reps=7, budget_s=0.07, rounds=6, gemm_ms=(1, 4, 16, 64, 256),
                  attn_points=((1, 128), (8, 128), (32, 128), (1, 1024), (8, 1024), (32, 1024)),
                  cold_bytes=256 * 2**20, cold_min_bytes=2**20)  # fmt: skip
CPU_FULL = Sizes(copy_bytes=256 * 2**20, matmul_n=1024, iters=5, warmup=3, launches=50000, max_seconds_per_dtype=1.5,
                 reps=11, budget_s=0.3, rounds=3, gemm_ms=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
                 attn_points=((1, 256), (1, 2048), (8, 256), (16, 1024)), cold_bytes=256 * 2**20,
                 cold_min_bytes=2**20)  # fmt: skip
GPU_QUICK = Sizes(copy_bytes=1 * 2**30, matmul_n=4096, iters=20, warmup=3, launches=3000, max_seconds_per_dtype=1.0,
                  reps=5, budget_s=0.05, gemm_k=4096, gemm_ms=(1, 8, 16, 64, 128, 512, 2048),
                  attn_points=((1, 128), (1, 1024), (16, 1024), (64, 128), (64, 1024)),
                  attn_heads=(16, 8, 128), cold_bytes=512 * 2**20)  # fmt: skip
GPU_FULL = Sizes(copy_bytes=2 * 2**30, matmul_n=8192, iters=30, warmup=5, launches=5000, max_seconds_per_dtype=6.0,
                 reps=7, budget_s=0.15, gemm_k=4096, gemm_ms=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
                 attn_points=((1, 128), (1, 1024), (1, 8192), (16, 1024), (64, 1024), (64, 4096)), attn_heads=(16, 8, 128),
                 cold_bytes=512 * 2**20)  # fmt: skip
CPU_SIZES, GPU_SIZES = CPU_QUICK, GPU_FULL  # names kept for callers of the first calibrate


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_clock() -> tuple[Callable[[], float], str]:
    """The clock host-side timings use: process CPU time when torch runs one thread, else the wall clock.

    With one thread, CPU time is what the step costs whatever else the host runs; with several,
    idle OpenMP workers spin and CPU time overstates, so the wall clock is the only honest one."""
    if torch.get_num_threads() == 1:
        return time.process_time, "process CPU time (1 torch thread)"
    return time.perf_counter, f"wall clock ({torch.get_num_threads()} torch threads)"


def trimmed(samples: Sequence[float]) -> float:
    """The median of the fastest half: a neighbour's burst only ever adds time, so the slow half is noise."""
    s = sorted(samples)
    return statistics.median(s[: max(1, (len(s) + 1) // 2)])


@contextlib.contextmanager
def pinned_threads(threads: int | None) -> Iterator[int]:
    """torch's intra-op thread count fixed to ``threads`` (None: as it is) for the block; yields the count."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def _once(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    now = host_clock()[0]
    t0 = now()
    for _ in range(iters):
        fn()
    sync(device)
    return (now() - t0) / iters


def time_per_iter(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int, reps: int = 1,
                  graphed: bool = False) -> float:
    """Seconds per call: ``trimmed`` over ``reps`` runs of ``iters`` calls, after ``warmup`` calls.

    ``graphed`` (CUDA): the ``iters`` calls are captured once into a CUDA graph and replayed, so a
    small kernel's time is its device time, not the host's launch rate (a decode step replays a
    graph too); where capture fails the calls run eagerly."""
    for _ in range(warmup):
        fn()
    sync(device)
    if graphed and device.type == "cuda":
        replay = _captured(fn, device, iters)
        if replay is not None:
            return trimmed([_once(replay, device, 1) for _ in range(max(1, reps))]) / iters
    return trimmed([_once(fn, device, iters) for _ in range(max(1, reps))])


def _captured(fn: Callable[[], Any], device: torch.device, iters: int) -> Callable[[], Any] | None:
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        graph.replay()
        sync(device)
        return graph.replay
    except RuntimeError:
        return None


def iters_for(fn: Callable[[], Any], device: torch.device, budget_s: float, cap: int) -> int:
    """How many calls fit ``budget_s`` of wall time (the median of three timed calls decides, so neither the
    first call's warm-up nor one lucky call does; at least 1, at most ``cap``). Wall time on purpose: the
    budget is the user's wait, whatever clock the timing then uses."""
    calls = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        sync(device)
        calls.append(time.perf_counter() - t0)
    first = statistics.median(calls)
    return max(1, min(cap, int(budget_s / max(first, 1e-7))))


def measure_s(fn: Callable[[], Any], device: torch.device, sizes: Sizes, budget_s: float, cap: int = 10_000,
              graphed: bool = False) -> float:
    """Seconds per call within about ``budget_s``: ``sizes.reps`` runs sized to share it, ``trimmed``."""
    reps = max(1, sizes.reps)
    iters = iters_for(fn, device, budget_s / reps, cap)
    return time_per_iter(fn, device, iters, sizes.warmup, reps, graphed=graphed)


class Progress:
    """One stderr line per benchmark: what ran, what it found, how long it took."""

    def __init__(self, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self._start = self.t0
        self.lines: list[str] = []

    def start(self, what: str) -> None:
        self._start = time.perf_counter()
        self._what = what

    def done(self, result: str) -> None:
        now = time.perf_counter()
        line = f"calibrate [{now - self.t0:6.1f}s] {self._what}: {result} ({now - self._start:.1f}s)"
        self.lines.append(line)
        if self.enabled:
            print(line, file=self.stream, flush=True)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0
