"""What keeps one bad request from breaking a step for everyone else.

A step runs the whole batch through the program, then samples. When the program raises,
each request of the batch is run alone, so the ones that fail are known and the others
still get their step (re-running writes the same K/V slots with the same values, so the
survivors' cache is what a clean step leaves). A row of non-finite logits, or a row the
sampler cannot sample, fails only its own request. The engine then finishes the failed
requests with an error output; nothing here changes a sequence's state.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from portlayer.runtime.sequence import Sequence

Item = tuple[Sequence, int]


def execute_isolating_failures(runner: Any, items: Seq[Item], pending: torch.Tensor | None = None,
                               ) -> tuple[list[Item], list[Sequence], torch.Tensor | None, list[tuple[Sequence, str]]]:
    """(items that ran, sequences due a token, their logits rows, (sequence, message) for failures).
    ``pending``: the in-flight step's tokens (ModelRunner.prepare)."""
    try:
        due, logits = runner.execute(items, pending)
        return list(items), list(due), logits, []
    except Exception as e:
        if len(items) == 1:
            return [], [], None, [(items[0][0], f"the model step failed ({type(e).__name__}: {e})")]
    ran: list[Item] = []
    due_all: list[Sequence] = []
    rows: list[torch.Tensor] = []
    failed: list[tuple[Sequence, str]] = []
    for item in items:
        r, d, lg, f = execute_isolating_failures(runner, [item], pending)
        ran += r
        failed += f
        if d and lg is not None:
            due_all += d
            rows.append(lg)
    return ran, due_all, (torch.cat(rows) if rows else None), failed


def sample_guarded(sampler: Any, logits: torch.Tensor | None, seqs: Seq[Sequence]) -> list[int | str]:
    """One token per sequence, or the message saying why that sequence cannot have one.

    Greedy rows are decided together (one argmax); random rows one by one, in order, as the
    sampler itself does, so a failing row leaves every other row's random stream untouched."""
    if not seqs or logits is None:
        return []
    fast = getattr(sampler, "greedy_rows", None)
    try:
        rows = fast(logits, list(seqs)) if fast is not None else None
    except Exception as e:
        return [f"sampling failed ({type(e).__name__}: {e})"] * len(seqs)
    if rows is not None:
        return [int(t) if f else "the model produced non-finite logits (NaN or Inf) for this request"
                for t, f in zip(*rows)]
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    out: list[int | str] = ["the model produced non-finite logits (NaN or Inf) for this request" if not ok else ""
                            for ok in finite]
    greedy = [i for i, s in enumerate(seqs) if finite[i] and s.params.greedy]
    if greedy:
        rows = logits if len(greedy) == len(seqs) else logits[greedy]
        try:
            for i, tok in zip(greedy, sampler(rows, [seqs[i] for i in greedy])):
                out[i] = int(tok)
        except Exception as e:
            for i in greedy:
                out[i] = f"sampling failed ({type(e).__name__}: {e})"
    for i, seq in enumerate(seqs):
        if finite[i] and not seq.params.greedy:
            try:
                out[i] = int(sampler(logits[i : i + 1], [seq])[0])
            except Exception as e:
                out[i] = f"sampling failed ({type(e).__name__}: {e})"
    return out
