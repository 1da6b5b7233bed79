"""`portlayer bench`: latency and throughput of an artifact's executable on this device.

It times the executable directly (no scheduler), so the numbers are the compiled
program's: one prefill of N tokens, and decode steps at a few batch sizes against a
paged KV cache holding ``context`` tokens per sequence.
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


def _time(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def max_positions(graph: Any) -> int:
    """Longest position the graph supports: config max_positions, else the smallest rope table."""
    if graph.meta.get("max_positions"):
        return int(graph.meta["max_positions"])
    rows = [int(graph.params[n.inputs[2]].shape[0]) for n in graph.find("rope")
            if len(n.inputs) > 2 and n.inputs[2] in graph.params]
    return min(rows, default=4096)


def bench(loaded: Any, *, prefill_tokens: int = 128, context: int = 128, batch_sizes: Sequence[int] = (1, 8),
          warmup: int = 2, iters: int = 10) -> dict[str, Any]:
    from portlayer.runtime.validation import new_kv_cache, step_metadata

    exe = loaded.executable()
    graph = loaded.graph
    dev = torch.device(exe.device)
    limit = max_positions(graph)
    prefill_tokens, context = min(prefill_tokens, limit), min(context, limit - 1)
    vocab = int(graph.meta.get("vocab_size") or 2)
    block = int(loaded.plan.value("kv_block_size") or 16) if "kv_block_size" in loaded.plan.names() else 16
    causal = graph.meta.get("task", "causal_lm") == "causal_lm" and bool(graph.find("attention"))
    g = torch.Generator().manual_seed(0)
    report: dict[str, Any] = {
        "artifact": str(loaded.path), "model": loaded.manifest.model.get("spec"), "target": loaded.descriptor.name,
        "device": str(dev), "dtype": str(exe.dtype).removeprefix("torch."), "executable": type(exe).__name__,
    }
    ids = torch.randint(0, vocab, (prefill_tokens,), generator=g).to(dev)
    feeds = {"input_ids": ids, "positions": torch.arange(prefill_tokens, device=dev)}
    md = step_metadata([prefill_tokens], [0], block_size=None, max_len=prefill_tokens, device=dev)
    names = [v.name for v in graph.inputs]
    feed_last_rows(feeds, names, md)
    with torch.inference_mode():
        t = _time(lambda: exe.run(feeds, md, None), dev, warmup, iters)
    med = statistics.median(t)
    report["prefill"] = {"tokens": prefill_tokens, "latency_ms": med * 1e3, "tokens_per_s": prefill_tokens / med,
                         "min_ms": min(t) * 1e3}
    report["decode"] = []
    if causal:
        for b in batch_sizes:
            caches = new_kv_cache(graph, b, context + 1, block, exe.dtype, dev)
            mdd = step_metadata([1] * b, [context] * b, block_size=block, max_len=context + 1, device=dev)
            fd = {"input_ids": torch.randint(0, vocab, (b,), generator=g).to(dev),
                  "positions": torch.full((b,), context, dtype=torch.int64, device=dev)}
            feed_last_rows(fd, names, mdd)
            with torch.inference_mode():
                t = _time(lambda fd=fd, mdd=mdd, caches=caches: exe.run(fd, mdd, caches), dev, warmup, iters)
            med = statistics.median(t)
            report["decode"].append({"batch": b, "context": context, "step_ms": med * 1e3, "tokens_per_s": b / med,
                                     "min_ms": min(t) * 1e3})
    return report


def format_report(r: dict[str, Any]) -> str:
    lines = [f"bench {r['model']} for {r['target']} on {r['device']} ({r['dtype']}, {r['executable']})"]
    p = r["prefill"]
    lines.append(f"  prefill  {p['tokens']:>5} tokens   {p['latency_ms']:9.2f} ms   {p['tokens_per_s']:11.1f} tok/s")
    for d in r["decode"]:
        lines.append(f"  decode   batch {d['batch']:>3}      {d['step_ms']:9.2f} ms/step {d['tokens_per_s']:9.1f} tok/s"
                     f"  (context {d['context']})")
    return "\n".join(lines)
