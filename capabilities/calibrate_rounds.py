"""Several rounds of the whole benchmark suite, merged leaf by leaf into one result.

On a shared host the slow spells last seconds to minutes (a neighbour's test suite evicting the
caches at every context switch inflates even this process's CPU time, by up to 2x), longer than
any one measurement, so repeating a measurement back to back cannot outvote them. Contention only
ever adds time, so for every measured number the best round is kept (the shortest time, the
highest rate): the figure closest to what the device does undisturbed, and the one that
reproduces; `portlayer bench` keeps the best round the same way.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from portlayer.capabilities.calibrate_timing import sig

RATES = ("gbps", "tflops", "matmul")  # a leaf whose path names one of these is a rate: higher is better


def merge_rounds(rounds: Sequence[Any], path: str = "") -> Any:
    """The rounds' common structure with every float leaf its best over the rounds: the highest for a
    rate (a path naming GB/s, TFLOP/s or the matmul table), the lowest for a time.

    Integers (sizes, counts, crossovers' M) and strings are taken from the first round; lists of
    different lengths (a benchmark that failed in one round) keep the first round's."""
    first = rounds[0]
    if len(rounds) == 1:
        return first
    if isinstance(first, dict):
        return {k: merge_rounds([r[k] for r in rounds if isinstance(r, dict) and k in r], f"{path}.{k}") for k in first}
    if isinstance(first, list):
        if any(not isinstance(r, list) or len(r) != len(first) for r in rounds):
            return first
        return [merge_rounds([r[i] for r in rounds], path) for i in range(len(first))]
    if isinstance(first, float) and all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rounds):
        best = max if any(w in path for w in RATES) else min
        return sig(best(float(r) for r in rounds))
    return first


def spread_pct(rounds: Sequence[Any], prefix: str = "") -> dict[str, float]:
    """Every float leaf's (max - min) / median over the rounds in %: how much the host moved during the run."""
    first = rounds[0]
    out: dict[str, float] = {}
    if isinstance(first, dict):
        for k in first:
            if all(isinstance(r, dict) and k in r for r in rounds):
                out.update(spread_pct([r[k] for r in rounds], f"{prefix}{k}."))
    elif isinstance(first, list) and all(isinstance(r, list) and len(r) == len(first) for r in rounds):
        for i in range(len(first)):
            out.update(spread_pct([r[i] for r in rounds], f"{prefix}{i}."))
    elif isinstance(first, float) and all(isinstance(r, (int, float)) for r in rounds):
        med = statistics.median(rounds)
        if med > 0:
            out[prefix.rstrip(".")] = 100.0 * (max(rounds) - min(rounds)) / med
    return out
