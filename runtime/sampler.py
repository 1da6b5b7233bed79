"""Token sampling: greedy, temperature, top-k, top-p, with per-request random streams.

Greedy rows are decided together with one argmax (the common serving case, and the only
one the HF comparisons exercise). Random rows are sampled one by one so each request can
draw from its own seeded ``torch.Generator``: a seeded request then gives the same tokens
whatever else shares its batch, and across preemption (the generator lives on the
sequence, not the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portlayer.runtime.sequence import SamplingParams, Sequence


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) every logit outside the top-k and outside the smallest top-p nucleus of a row."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        drop_sorted = before > top_p
        drop_sorted[..., 0] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@dataclass
class PendingTokens:
    """One step's greedy tokens: on the device now, on the host once ``result()`` has waited for the copy."""

    tokens: torch.Tensor  # [rows] int64 on the device
    host: torch.Tensor  # [2, rows]: tokens, all-finite flags (pinned; filled by the in-flight copy)
    event: torch.cuda.Event | None

    def result(self) -> tuple[list[int], list[bool]]:
        if self.event is not None:
            self.event.synchronize()
        toks, finite = self.host.tolist()
        return toks, [bool(f) for f in finite]


class Sampler:
    """Picks one token per row of ``logits`` ([num_seqs, vocab]) by each sequence's params."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator | None:
        """One stream for unseeded requests (None: torch's global RNG, when no engine seed)."""
        if self.seed is None:
            return None
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        if logits.shape[0] != len(seqs):
            raise ValueError(f"sampler got {logits.shape[0]} logit rows for {len(seqs)} sequences")
        out: list[int | None] = [None] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        if greedy:
            rows = logits if len(greedy) == len(seqs) else logits[greedy]
            for i, tok in zip(greedy, rows.argmax(dim=-1).tolist()):
                out[i] = tok
        for i, seq in enumerate(seqs):
            if out[i] is None:
                out[i] = self._sample_row(logits[i], seq)
        return out  # type: ignore[return-value]

    def greedy_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[bool]] | None:
        """(argmax, all-finite) of every row in one device-to-host copy, the all-greedy step's only sync;
        None when a row needs more than its argmax (sampling, or a subclass recording logprobs)."""
        pending = self.greedy_async(logits, seqs)
        return None if pending is None else pending.result()

    def greedy_async(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingTokens | None:
        """greedy_rows without waiting: the argmax stays on the device (the next step's inputs read it
        there) and its host copy is in flight; None when a row needs more than its argmax. A subclass
        that records more per row (logprobs) overrides this (greedy_rows follows it)."""
        if not all(s.params.greedy for s in seqs):
            return None
        both = torch.stack((logits.argmax(dim=-1), torch.isfinite(logits).all(dim=-1).to(torch.int64)))
        if both.device.type == "cpu":
            return PendingTokens(both[0], both, None)
        if both.device.type != "cuda":  # no event to wait on here: copy now (correct, not overlapped)
            return PendingTokens(both[0], both.cpu(), None)
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingTokens(both[0], host, event)

    def _sample_row(self, row: torch.Tensor, seq: Sequence) -> int:
        p: SamplingParams = seq.params
        if p.seed is not None and seq.generator is None:
            seq.generator = torch.Generator(device=row.device).manual_seed(p.seed)
        gen = seq.generator if p.seed is not None else self._shared_generator(row.device)
        scaled = apply_top_k_top_p(row.float() / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(scaled, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen).item())


#: below this a temperature over/underflows float32 logits (vLLM treats it as greedy; we refuse it)
MIN_TEMPERATURE = 1e-5


def check_sampling_params(p: SamplingParams, request_id: str) -> None:
    """Refuse values the sampler cannot use (NaN/Inf, out of range, wrong type) before anything is queued.

    SamplingParams' own checks let NaN through (every comparison with NaN is False) and do not
    check types; a value refused here would otherwise fail inside a step, mid-batch."""
    import math

    from portlayer.runtime.sequence import RequestRejected

    def bad(field: str, why: str) -> RequestRejected:
        return RequestRejected(f"request {request_id}: sampling parameter {field}={getattr(p, field)!r} {why}")

    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(p, SamplingParams):
        raise RequestRejected(f"request {request_id}: params must be a SamplingParams, not {type(p).__name__}")
    t = p.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise bad("temperature", "must be a finite number >= 0 (0 is greedy)")
    if 0 < t < MIN_TEMPERATURE:
        raise bad("temperature", f"is too small to sample with (below {MIN_TEMPERATURE:g}); use 0 for greedy")
    tp = p.top_p
    if isinstance(tp, bool) or not isinstance(tp, (int, float)) or not math.isfinite(tp) or not 0.0 < tp <= 1.0:
        raise bad("top_p", "must be a finite number in (0, 1] (1 disables it)")
    if not is_int(p.top_k):
        raise bad("top_k", "must be an integer (0 or negative disables it)")
    if not is_int(p.max_tokens) or p.max_tokens < 1:
        raise bad("max_tokens", "must be an integer >= 1")
    if p.seed is not None and (not is_int(p.seed) or not 0 <= p.seed < 2**63):
        raise bad("seed", "must be None or an integer in [0, 2**63)")
    if not all(is_int(t) for t in p.stop_token_ids):
        raise bad("stop_token_ids", "must be integers")
