"""Request state: what one generation request asked for and how far it has got.

A sequence is the prompt plus the tokens generated so far. ``num_computed_tokens`` counts
the leading tokens whose K/V already sit in the paged cache; the scheduler hands the
model the tokens after it (a prefill chunk, or the one newest token of a decode). That
one counter covers chunked prefill, prefix-cache hits (it starts above zero) and
preemption by recompute (it drops back to zero) without any special case.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from portlayer.errors import PortlayerError


class RequestRejected(PortlayerError):
    """A request can never run (too long for the model or the KV cache); others go on."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (vLLM's names and defaults, except as noted).

    temperature 0 is greedy. top_k <= 0 and top_p 1.0 disable those filters. ``seed`` gives
    the request its own random stream, so its output does not depend on batch neighbours.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request. Plain data: the scheduler, block manager and runner update it in place."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # tokens served from the prefix cache at (latest) admission
    num_hashed_blocks: int = 0  # leading full blocks already registered in the prefix cache
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    finish_reason: str | None = None  # stop | length | abort
    generator: torch.Generator | None = None
    num_emitted: int = 0  # output tokens already reported by a stream

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))

    def append_pending(self, row: int) -> int:
        """Append a token still on the device (row ``row`` of the in-flight step's samples) as the
        negative placeholder -(row + 1); the next step's inputs read the real id on the device. Returns
        its index, where the engine writes the real id once it reaches the host."""
        self.output_token_ids.append(-(row + 1))
        return len(self.output_token_ids) - 1

    def drop_pending(self) -> None:
        """Remove placeholders at the end (a sequence that stops never shows one)."""
        outs = self.output_token_ids
        while outs and outs[-1] < 0:
            outs.pop()

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def stop_reason(self, eos_token_id: int | None, max_model_len: int, upto: int | None = None) -> str | None:
        """Why the sequence must stop after its newest token (or after output token ``upto - 1``, when a
        placeholder of an in-flight step follows it), or None to go on."""
        p = self.params
        n = len(self.output_token_ids) if upto is None else upto
        last = self.output_token_ids[n - 1]
        if not p.ignore_eos and eos_token_id is not None and last == eos_token_id:
            return "stop"
        if last in p.stop_token_ids:
            return "stop"
        if n >= p.max_tokens or len(self.prompt_token_ids) + n >= max_model_len:
            return "length"
        return None


class RequestOutput:
    """What a caller sees of a request: all tokens so far, plus the ones new since last time.

    Built every step for every sequence that got a token, so it copies nothing eagerly:
    ``prompt_token_ids`` is the request's own (never mutated) prompt list and ``token_ids`` is
    taken on first access as a prefix of the sequence's output list, which only ever grows.
    Copying both each step made a long generation cost O(length^2) host time.
    """

    __slots__ = ("request_id", "prompt_token_ids", "_token_ids", "_source", "_length", "new_token_ids",
                 "finished", "finish_reason", "text", "error", "num_cached_tokens", "num_preemptions")

    def __init__(self, request_id: str, prompt_token_ids: list[int], token_ids: list[int] | None,
                 new_token_ids: list[int], finished: bool, finish_reason: str | None = None,
                 text: str | None = None, error: str | None = None, num_cached_tokens: int = 0,
                 num_preemptions: int = 0, *, source: list[int] | None = None, length: int = 0) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._token_ids = token_ids
        self._source, self._length = source, length
        self.new_token_ids = new_token_ids
        self.finished = finished
        self.finish_reason = finish_reason
        self.text = text
        self.error = error
        self.num_cached_tokens = num_cached_tokens
        self.num_preemptions = num_preemptions

    @property
    def token_ids(self) -> list[int]:
        if self._token_ids is None:
            self._token_ids = list(self._source[: self._length]) if self._source is not None else []
        return self._token_ids

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, token_ids={self.token_ids!r}, "
                f"finished={self.finished}, finish_reason={self.finish_reason!r}, error={self.error!r})")

    @staticmethod
    def of(seq: Sequence, text: str | None = None, upto: int | None = None) -> RequestOutput:
        """The output after ``seq``'s first ``upto`` output tokens (default: all; a placeholder of the
        next, in-flight step may follow them)."""
        n = len(seq.output_token_ids) if upto is None else upto
        new = seq.output_token_ids[seq.num_emitted : n]
        seq.num_emitted = n
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=None,
            new_token_ids=new,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            text=text,
            num_cached_tokens=seq.num_cached_prompt_tokens,
            num_preemptions=seq.num_preemptions,
            source=seq.output_token_ids,
            length=n,
        )
