"""Log-probabilities of sampled tokens, for the requests that ask for them.

A ``Sampler`` subclass, so the engine's step is untouched: it picks tokens exactly as the
plain sampler does, then, for the rows whose request asked for logprobs, records the
log-softmax of the model's raw logits (before temperature and top-k/top-p, as vLLM reports
them by default): the chosen token's value and the ``k`` most likely alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portlayer.runtime.sampler import PendingTokens, Sampler
from portlayer.runtime.sequence import Sequence


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


class LogprobSampler(Sampler):
    """``want[request_id] = k`` asks for logprobs; records are taken with ``take(request_id)``."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self.want: dict[str, int] = {}
        self._records: dict[str, list[TokenLogprob]] = {}

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        tokens = super().__call__(logits, seqs)
        if self.want:
            for i, seq in enumerate(seqs):
                k = self.want.get(seq.request_id)
                if k is None:
                    continue
                lp = torch.log_softmax(logits[i].float(), dim=-1)
                top = torch.topk(lp, k) if k > 0 else None
                pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
                rec = TokenLogprob(tokens[i], float(lp[tokens[i]]), pairs)
                self._records.setdefault(seq.request_id, []).append(rec)
        return tokens

    def greedy_async(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingTokens | None:
        """Also greedy_rows' rule (it calls this): rows asking for logprobs go through __call__, which records them."""
        if any(s.request_id in self.want for s in seqs):
            return None
        return super().greedy_async(logits, seqs)

    def take(self, request_id: str) -> list[TokenLogprob]:
        return self._records.pop(request_id, [])

    def forget(self, request_id: str) -> None:
        self.want.pop(request_id, None)
        self._records.pop(request_id, None)
