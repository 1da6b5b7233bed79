"""Text of a generation as it streams: incremental detokenization and stop strings.

Decoding the whole output after every token costs O(length^2); decoding only the newest
token breaks multi-byte characters and tokenizers that merge pieces (SentencePiece's
leading spaces). ``TextStream`` does what vLLM and HF's TextStreamer do: decode a short
window that starts at the last emitted character boundary, emit the part past the previous
window, and hold back text that still ends in an incomplete character (U+FFFD).

Stop strings are matched on that text. The output ends *before* the stop string (OpenAI's
and vLLM's behaviour), and while streaming the last ``len(longest stop) - 1`` characters are
held back, so a client never receives the start of a stop string that completes later.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"


class TextStream:
    """Accumulate token ids into text; ``add`` returns the newly safe-to-send text."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # all text decoded so far (cut at a stop string once one matched)
        self.stop_reason: str | None = None  # the stop string that ended the text
        self._prefix = 0  # window start (token index) for the next decode
        self._read = 0  # tokens whose text is already in self.text
        self._sent = 0  # characters of self.text handed out by add()
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Feed new tokens; the text that may be sent now (all of it when ``final``)."""
        if self.stopped:
            return ""
        self.token_ids.extend(int(t) for t in new_ids)
        if self.tokenizer is not None and len(self.token_ids) > self._read:
            before = self._decode(self.token_ids[self._prefix : self._read])
            after = self._decode(self.token_ids[self._prefix :])
            if len(after) > len(before) and (final or not after.endswith(_INCOMPLETE)):
                self._append(after[len(before) :])
                self._prefix, self._read = self._read, len(self.token_ids)
        safe = len(self.text) if (final or self.stopped) else max(self._sent, len(self.text) - self._holdback)
        out, self._sent = self.text[self._sent : safe], safe
        return out

    def _append(self, delta: str) -> None:
        start = max(0, len(self.text) - self._holdback)  # a stop string may straddle the old tail
        self.text += delta
        if not self.stop:
            return
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            pos, s = min(hits)
            self.text, self.stop_reason = self.text[:pos], s
