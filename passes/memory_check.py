"""The memory-plan checker: proves that no two simultaneously live buffers overlap.

Independent of the planner: it reads only ``graph.meta["memory_plan"]`` (docs/contracts.md)
and evaluates every size at each bucket and at extra token counts up to ``max_tokens``
(offsets are ints planned at ``max_tokens``; smaller steps use the same offsets). Two buffers
are live together when their [start, end] kernel intervals intersect; the one exception is a
declared in-place pair (``inplace_of``: the output takes the region of an input that dies in
the very kernel that produces it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from portlayer.flatten.ir import eval_dim

EXTRA_TOKENS = (1, 3, 17, 100, 513, 4097)


class MemoryPlanError(ValueError):
    """A memory plan puts two live buffers on the same bytes, or misaligns one."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        more = f" (+{len(problems) - 10} more)" if len(problems) > 10 else ""
        super().__init__("memory plan is unsafe: " + "; ".join(problems[:10]) + more +
                         ". Re-run passes/memory_plan.py; do not edit offsets by hand.")


def _bindings(plan: Mapping[str, Any], extra: Iterable[int]) -> list[dict[str, int]]:
    top = int(plan.get("max_tokens", 1 << 30))
    counts = sorted(n for n in {int(b) for b in plan.get("peak_bytes", {})} | set(extra) if n <= top)
    return [{"num_tokens": n, "num_seqs": n} for n in counts]


def check_memory_plan(plan: Mapping[str, Any], extra_tokens: Iterable[int] = EXTRA_TOKENS) -> int:
    """Raise MemoryPlanError listing every overlap or misalignment; returns the pairs checked."""
    align = int(plan["alignment"])
    bufs = plan["buffers"]
    problems: list[str] = []
    checked = 0
    for b in _bindings(plan, extra_tokens):
        placed = []
        for name, buf in bufs.items():
            off, size = eval_dim(buf["offset"], b), eval_dim(buf["size"], b)
            if off % align:
                problems.append(f"{name}: offset {off} at num_tokens={b['num_tokens']} is not a multiple of {align}")
            placed.append((name, off, off + size, buf["start"], buf["end"], buf.get("inplace_of")))
        for i, (n1, lo1, hi1, s1, e1, ip1) in enumerate(placed):
            for n2, lo2, hi2, s2, e2, ip2 in placed[i + 1:]:
                if s1 > e2 or s2 > e1:
                    continue
                checked += 1
                if (ip1 == n2 and s1 == e2) or (ip2 == n1 and s2 == e1):
                    if lo1 == lo2:
                        continue
                if lo1 < hi2 and lo2 < hi1:
                    problems.append(f"{n1} [{lo1}, {hi1}) and {n2} [{lo2}, {hi2}) overlap while both live "
                                    f"(kernels {max(s1, s2)}..{min(e1, e2)}) at num_tokens={b['num_tokens']}")
    if problems:
        raise MemoryPlanError(problems)
    return checked
