"""Continuous batching with chunked prefill and preemption by recompute (vLLM v1's shape).

Each step has a token budget (``max_batched_tokens``). Running sequences are served
first, oldest first: a decode takes one token, an unfinished prefill takes its next chunk
(at most ``chunk_size`` tokens). When the KV blocks run out, the newest running sequence
is preempted: its blocks are freed and it goes back to the *front* of the waiting queue,
to be recomputed (its prompt and outputs re-prefilled) when room returns. Waiting
sequences are admitted in arrival order while blocks, sequence slots and budget allow;
admission stops at the first one that does not fit (no overtaking, so nobody starves),
and is skipped entirely in a step that had to preempt.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from portlayer.runtime.block_manager import BlockManager
from portlayer.runtime.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_batched_tokens: int
    chunk_size: int  # the most prompt tokens one sequence prefills in a step

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_batched_tokens", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ScheduledBatch:
    """One step's work: (sequence, number of new tokens) pairs, prefills before decodes."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    @property
    def empty(self) -> bool:
        return not self.items


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, self.config.chunk_size, budget)
            while not self.bm.allocate_slots(seq, n):
                victim = self.running.pop()  # newest; never one already scheduled (they sit before i)
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                batch.items.append((seq, n))
                budget -= n
                i += 1
        if not batch.preempted:
            self._admit(batch, budget)
        batch.items.sort(key=lambda item: item[1] == 1)  # stable: prefills first, then decodes
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self.bm.lookup_prefix(seq.token_ids)
            cached = len(hits) * self.bm.block_size
            n = min(seq.num_tokens - cached, self.config.chunk_size, budget)
            if self.bm.admission_cost(hits, cached + n) > self.bm.num_free_blocks:
                break
            self.waiting.popleft()
            self.bm.take_prefix(seq, hits)
            ok = self.bm.allocate_slots(seq, n)
            assert ok, "admission_cost promised enough free blocks"
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.items.append((seq, n))
            budget -= n

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def leave(self, seq: Sequence) -> None:
        """Stop scheduling ``seq`` but keep its blocks: its last token is in flight (runtime/overlap.py);
        ``finish`` follows once the token is known."""
        if seq in self.running:
            self.running.remove(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of scheduling (it stopped, or the caller aborted it)."""
        seq.drop_pending()
        seq.finish(reason)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
