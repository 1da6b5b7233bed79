"""Overlapped steps: the host schedules and launches step N+1 while step N still runs on the device.

A step's greedy tokens stay on the device (Sampler.greedy_async): each sequence gets a placeholder
token, the next step's inputs read the real id there (ModelRunner.prepare), and the host learns the
ids one step later, while the device runs the next step. Nothing the scheduler decides depends on a
token's value except stopping: a sequence that reaches its length limit leaves scheduling at once
(its next step would be wasted), one that meets EOS or a stop token is finished when its token
arrives (the step in flight computed one extra token for it, which is dropped). Prefix-cache blocks
are hashed once their tokens are known. Outputs equal the synchronous engine's: the same batches
run, and device work is ordered on one stream, so blocks freed while a step is in flight are reused
only by later steps.

Steps that need their tokens on the host before sampling (temperature, logprobs) run as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from portlayer.runtime.sampler import PendingTokens
from portlayer.runtime.sequence import RequestOutput, Sequence
from portlayer.runtime.step_guard import execute_isolating_failures, sample_guarded

Item = tuple[Sequence, int]


@dataclass
class InFlight:
    """A launched step whose sampled tokens have not reached the host."""

    ran: list[Item]
    due: list[Sequence]
    logits: torch.Tensor | None
    pending: PendingTokens | None  # None: sample on the host (the step is not overlapped)
    slots: list[int] = field(default_factory=list)  # per due sequence: the index of its placeholder


def launch(engine: Any, batch: Any, prev: InFlight | None, outputs: list[RequestOutput], overlap: bool) -> InFlight:
    """Run ``batch`` (inputs may read ``prev``'s tokens on the device); failures go to ``outputs``.
    ``overlap``: keep greedy tokens on the device (resolve them next step), else sample_now follows."""
    ran, due, logits, failed = execute_isolating_failures(engine.runner, batch.items,
                                                          prev.pending.tokens if prev and prev.pending else None)
    for seq, msg in failed:
        outputs.append(engine._fail(seq, msg))
    for seq, n in ran:
        seq.num_computed_tokens += n  # prefix-cache hashing waits for the tokens (resolve)
    pending = engine.sampler.greedy_async(logits, due) if overlap and due and logits is not None else None
    step = InFlight(ran, due, logits, pending)
    if pending is not None:
        limit = engine.config.max_model_len
        for row, seq in enumerate(due):
            step.slots.append(seq.append_pending(row))
            if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= limit:
                engine.scheduler.leave(seq)  # stops after this token whatever it is: no next step
    return step


def resolve(engine: Any, step: InFlight) -> list[RequestOutput]:
    """Wait for ``step``'s tokens (an overlapped step: ``pending`` set); append them, stop what stops,
    hash filled blocks; the outputs."""
    assert step.pending is not None, "a step sampled on the host is finished by sample_now"
    toks, finite = step.pending.result()
    outputs: list[RequestOutput] = []
    for seq, slot, tok, ok in zip(step.due, step.slots, toks, finite):
        if seq.finished:  # aborted or failed while in flight
            continue
        if not ok:
            outputs.append(engine._fail(seq, "the model produced non-finite logits (NaN or Inf) for this request"))
            continue
        seq.output_token_ids[slot] = int(tok)
        outputs.append(_stop_or_go(engine, seq, slot + 1))
    _hash_computed(engine, step)
    return outputs


def sample_now(engine: Any, step: InFlight) -> list[RequestOutput]:
    """The synchronous tail of a step: sample on the host, append, stop, outputs."""
    _hash_computed(engine, step)
    outputs: list[RequestOutput] = []
    live = [s for s in step.due if not s.finished]
    rows = step.logits if len(live) == len(step.due) or step.logits is None else step.logits[
        torch.tensor([i for i, s in enumerate(step.due) if not s.finished], device=step.logits.device)]
    for seq, tok in zip(live, sample_guarded(engine.sampler, rows, live)):
        if isinstance(tok, str):
            outputs.append(engine._fail(seq, tok))
            continue
        seq.append_token(tok)
        outputs.append(_stop_or_go(engine, seq))
    return outputs


def _stop_or_go(engine: Any, seq: Sequence, upto: int | None = None) -> RequestOutput:
    """Finish ``seq`` if its token at ``upto - 1`` (default: its newest) stops it; its output either way.
    Finishing drops the placeholder of a step in flight, if any."""
    reason = seq.stop_reason(engine.eos_token_id, engine.config.max_model_len, upto)
    if reason:
        engine.scheduler.finish(seq, reason)
        engine.requests.pop(seq.request_id, None)
    return engine._output(seq, upto)


def _hash_computed(engine: Any, step: InFlight) -> None:
    """Register the prefix-cache blocks the step's sequences filled (their tokens are known now)."""
    for seq, _ in step.ran:
        if not seq.finished:
            engine.block_manager.register_computed(seq)
