"""Token sampling: greedy, temperature, top-k, top-p, with per-request random streams.

Greedy rows are decided together with one argmax (the common serving case, and the only
one the HF comparisons exercise). Random rows are sampled one by one so each request can
draw from its own seeded ``torch.Generator``: a seeded request then gives the same tokens
whatever else shares its batch, and across preemption (the generator lives on the
sequence, not the step).
"""

from __future__ import annotations

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

    def _sample_row(self, row: torch.Tensor, seq: Sequence) -> int:
        p: SamplingParams = seq.params
        if p.seed is not None and seq.generator is None:
            seq.generator = torch.Generator(device=row.device).manual_seed(p.seed)
        gen = seq.generator if p.seed is not None else self._shared_generator(row.device)
        scaled = apply_top_k_top_p(row.float() / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(scaled, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen).item())
