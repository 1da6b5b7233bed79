"""`portlayer bench`: latency and throughput of an artifact's executable on this device.

It times the executable directly (no scheduler), so the numbers are the compiled
program's: one prefill of N tokens, and decode steps at a few batch sizes against a
paged KV cache holding ``context`` tokens per sequence. The steps are timed in ``rounds``
interleaved passes (prefill, each decode batch, then again), so a slow spell of a shared host
lands on one pass of every step rather than on all passes of one. Each step reports the median
wall time over every pass (``step_ms`` / ``latency_ms``); on the CPU with one torch thread also
the process's CPU time, the best pass's median (``cpu_ms``): the clock and estimator
`portlayer calibrate` uses, which the predicted column is compared with.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from portlayer.flatten.logits import feed_last_rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type not in ("cpu", "meta") and hasattr(getattr(torch, device.type, None), "synchronize"):
        getattr(torch, device.type).synchronize()


def _cpu_clock(device: torch.device) -> bool:
    """Process CPU time is the step's cost only on the CPU with one torch thread (idle workers spin otherwise)."""
    return device.type == "cpu" and torch.get_num_threads() == 1


def _time(fn: Callable[[], Any], device: torch.device, iters: int) -> tuple[list[float], list[float]]:
    """``iters`` timed calls: (wall seconds, process CPU seconds) per call."""
    wall, cpu = [], []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        _sync(device)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def _timed_rounds(steps: Sequence[Callable[[], Any]], device: torch.device, warmup: int, iters: int,
                  rounds: int) -> list[dict[str, Any]]:
    """Each step warmed up, then ``rounds`` interleaved passes of ``iters`` calls of every step."""
    for fn in steps:
        for _ in range(warmup):
            fn()
    _sync(device)
    walls: list[list[float]] = [[] for _ in steps]
    cpus: list[list[float]] = [[] for _ in steps]
    for _ in range(max(1, rounds)):
        for i, fn in enumerate(steps):
            w, c = _time(fn, device, iters)
            walls[i] += w
            cpus[i].append(statistics.median(c))
    out = []
    for w, c in zip(walls, cpus):
        row = {"ms": statistics.median(w) * 1e3, "min_ms": min(w) * 1e3}
        if _cpu_clock(device):
            row["cpu_ms"] = min(c) * 1e3
        out.append(row)
    return out


def max_positions(graph: Any) -> int:
    """Longest position the graph supports: config max_positions, else the smallest rope table."""
    if graph.meta.get("max_positions"):
        return int(graph.meta["max_positions"])
    rows = [int(graph.params[n.inputs[2]].shape[0]) for n in graph.find("rope")
            if len(n.inputs) > 2 and n.inputs[2] in graph.params]
    return min(rows, default=4096)


def kv_block_size(plan: Any) -> int:
    """The plan's KV block size (16 when the plan has none)."""
    return int(plan.value("kv_block_size") or 16) if "kv_block_size" in plan.names() else 16


def decode_step(graph: Any, exe: Any, batch: int, context: int, block: int,
                generator: torch.Generator) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """One decode step's inputs as `portlayer bench` times it: ``batch`` sequences of one new token after
    ``context`` cached ones in a fresh paged KV cache: (feeds, attention metadata, KV caches) for ``exe.run``."""
    from portlayer.codegen.host_support import kv_cache_dtype
    from portlayer.runtime.validation import new_kv_cache, step_metadata

    dev = torch.device(exe.device)
    vocab = int(graph.meta.get("vocab_size") or 2)
    caches = new_kv_cache(graph, batch, context + 1, block, kv_cache_dtype(exe), dev)
    md = step_metadata([1] * batch, [context] * batch, block_size=block, max_len=context + 1, device=dev)
    feeds = {"input_ids": torch.randint(0, vocab, (batch,), generator=generator).to(dev),
             "positions": torch.full((batch,), context, dtype=torch.int64, device=dev)}
    feed_last_rows(feeds, [v.name for v in graph.inputs], md)
    return feeds, md, caches


def bench(loaded: Any, *, prefill_tokens: int = 128, context: int = 128, batch_sizes: Sequence[int] = (1, 8),
          warmup: int = 2, iters: int = 10, rounds: int = 3) -> dict[str, Any]:
    from portlayer.codegen.host_support import kv_cache_dtype
    from portlayer.runtime.validation import new_kv_cache, step_metadata

    exe = loaded.executable()
    graph = loaded.graph
    dev = torch.device(exe.device)
    limit = max_positions(graph)
    prefill_tokens, context = min(prefill_tokens, limit), min(context, limit - 1)
    vocab = int(graph.meta.get("vocab_size") or 2)
    block = kv_block_size(loaded.plan)
    causal = graph.meta.get("task", "causal_lm") == "causal_lm" and bool(graph.find("attention") or graph.find("mla_attention"))
    g = torch.Generator().manual_seed(0)
    report: dict[str, Any] = {
        "artifact": str(loaded.path), "model": loaded.manifest.model.get("spec"), "target": loaded.descriptor.name,
        "device": str(dev), "dtype": str(exe.dtype).removeprefix("torch."), "executable": type(exe).__name__,
        "threads": torch.get_num_threads(), "rounds": rounds, "iters": iters,
        "clock": "wall; process CPU time (cpu_ms)" if _cpu_clock(dev) else "wall",
    }  # fmt: skip
    ids = torch.randint(0, vocab, (prefill_tokens,), generator=g).to(dev)
    feeds = {"input_ids": ids, "positions": torch.arange(prefill_tokens, device=dev)}
    # a causal LM's prefill as the engine runs it: into a paged KV cache (a step graph where the program has them)
    pre_caches = (new_kv_cache(graph, 1, prefill_tokens + 1, block, kv_cache_dtype(exe), dev) if causal else None)
    md = step_metadata([prefill_tokens], [0], block_size=block if causal else None, max_len=prefill_tokens + 1,
                       device=dev)
    names = [v.name for v in graph.inputs]
    feed_last_rows(feeds, names, md)
    steps = [lambda: exe.run(feeds, md, pre_caches)]
    for b in batch_sizes if causal else ():
        fd, mdd, caches = decode_step(graph, exe, b, context, block, g)
        steps.append(lambda fd=fd, mdd=mdd, caches=caches: exe.run(fd, mdd, caches))
    with torch.inference_mode():
        timed = _timed_rounds(steps, dev, warmup, iters, rounds)
    p = timed[0]
    report["prefill"] = {"tokens": prefill_tokens, "paged": causal, "latency_ms": p["ms"], "tokens_per_s": prefill_tokens / p["ms"] * 1e3,
                         "min_ms": p["min_ms"], **({"cpu_ms": p["cpu_ms"]} if "cpu_ms" in p else {})}
    report["decode"] = []
    for b, t in zip(batch_sizes if causal else (), timed[1:]):
        report["decode"].append({"batch": b, "context": context, "step_ms": t["ms"], "tokens_per_s": b / t["ms"] * 1e3,
                                 "min_ms": t["min_ms"], **({"cpu_ms": t["cpu_ms"]} if "cpu_ms" in t else {})})
    return report


def measured_ms(row: dict[str, Any]) -> float:
    """The figure a prediction is compared with: CPU time where it was taken (one-thread CPU), else the wall median."""
    return float(row.get("cpu_ms") or row.get("step_ms") or row["latency_ms"])


def format_report(r: dict[str, Any]) -> str:
    lines = [f"bench {r['model']} for {r['target']} on {r['device']} ({r['dtype']}, {r['executable']}, "
             f"{r.get('threads', '?')} torch threads, {r.get('rounds', 1)} rounds x {r.get('iters', '?')} iters)"]
    p = r["prefill"]
    cpu = lambda row: f"   cpu {row['cpu_ms']:9.2f} ms" if "cpu_ms" in row else ""  # noqa: E731
    lines.append(f"  prefill  {p['tokens']:>5} tokens   {p['latency_ms']:9.2f} ms   {p['tokens_per_s']:11.1f} tok/s{cpu(p)}")
    for d in r["decode"]:
        lines.append(f"  decode   batch {d['batch']:>3}      {d['step_ms']:9.2f} ms/step {d['tokens_per_s']:9.1f} tok/s"
                     f"  (context {d['context']}){cpu(d)}")
    return "\n".join(lines)
