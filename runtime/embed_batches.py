"""How an embedding request's sequences become program steps, and how those steps share the cores.

Batches: sequences sorted by length, cut into runs of about equal tokens under the token budget
(as many as a multiple of the workers, so they finish together), so a batch holds sequences
of similar lengths (the CPU attention then needs no padding: codegen/torch_attention.py) and the
order of the results is restored afterwards.

Cores: the descriptor's ``tuning.intra_op_threads`` (measured, with its source) says how many
threads one step should use. Fewer than the process has means several batches run side by side,
each on that many threads: on a CPU, a step of small GEMMs and row ops spends much of its
time in the intra-op threads' barriers, while independent batches need none. Only programs that
declare ``REENTRANT`` (no shared activation arena: the torch host programs) run steps side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


def _cut(order: list[int], lens: Sequence[int], n: int) -> list[list[int]]:
    """``order`` cut into at most ``n`` contiguous runs of about equal tokens (by each sequence's midpoint)."""
    total = sum(lens[i] for i in order)
    runs: list[list[int]] = [[] for _ in range(n)]
    done = 0
    for i in order:
        runs[min(n - 1, int((done + lens[i] / 2) * n / total))].append(i)
        done += lens[i]
    return [r for r in runs if r]


def plan_batches(lens: Sequence[int], budget: int, workers: int = 1) -> list[list[int]]:
    """Indices of the sequences in each batch: sorted longest first and cut into runs of about equal
    tokens, at most ``budget`` a batch (a longer sequence goes alone), as many batches as a multiple of
    ``workers`` (so the workers finish together) when there are that many sequences."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    total = sum(lens)
    if not order or not total:
        return [order] if order else []
    w = max(1, min(workers, len(order)))
    n = w * max(1, -(-total // (w * max(1, budget))))
    while n < len(order):
        batches = _cut(order, lens, n)
        if all(len(b) == 1 or sum(lens[i] for i in b) <= budget for b in batches):
            return batches
        n += w
    return [[i] for i in order]


def step_workers(executable: Any, descriptor: Any) -> tuple[int, int]:
    """(steps side by side, threads per step) for this process, from the descriptor's tuning."""
    have = torch.get_num_threads()
    tuning = getattr(descriptor, "tuning", None) or {}
    per = int(tuning.get("intra_op_threads") or 0)
    if per <= 0 or per >= have or not getattr(executable, "REENTRANT", False):
        return 1, have
    return have // per, per


class BatchRunner:
    """Runs ``fn(batch)`` for each batch, ``workers`` at a time on ``threads`` intra-op threads each."""

    def __init__(self, workers: int, threads: int) -> None:
        self.workers, self.threads = workers, threads
        self._pool: ThreadPoolExecutor | None = None

    def map(self, fn: Callable[[list[int]], torch.Tensor], batches: list[list[int]]) -> list[torch.Tensor]:
        if self.workers <= 1 or len(batches) <= 1:
            return [fn(b) for b in batches]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="portlayer-embed")
        main = torch.get_num_threads()

        def one(b: list[int]) -> torch.Tensor:
            torch.set_num_threads(self.threads)  # this worker's OpenMP/MKL threads (thread-local settings)
            return fn(b)

        try:
            return list(self._pool.map(one, batches))
        finally:
            torch.set_num_threads(main)  # the process default the workers' calls overwrote; main's own is unchanged
