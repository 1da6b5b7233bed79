"""Where one step's time goes: host issue (until ``run`` returns), the device's span (CUDA events) and its
kernels' sum (torch.profiler), for a mixed prefill+decode step as serving runs them, the same prefill alone,
and the decode alone (eager and replayed). A diagnosis script: it prints tables and writes JSON, asserts nothing.

    python scripts/gpu_mixed_step.py ARTIFACT out.json [--prefill 1024,824] [--decodes 200] [--context 600]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _bootstrap import bootstrap  # noqa: E402

bootstrap()

import torch  # noqa: E402


def case(graph, exe, prefill: list[int], decodes: int, context: int, block: int, gen: torch.Generator):  # noqa: ANN001, ANN201
    """Feeds, metadata and caches of one step: ``prefill`` chunks from position 0, then ``decodes`` sequences of one
    token after ``context`` cached ones (prefills first, as the scheduler orders them)."""
    from portlayer.codegen.host_support import kv_cache_dtype
    from portlayer.flatten.logits import feed_last_rows
    from portlayer.runtime.validation import new_kv_cache, step_metadata

    dev = torch.device(exe.device)
    lens = list(prefill) + [1] * decodes
    ctx = [0] * len(prefill) + [context] * decodes
    max_len = max(c + n for c, n in zip(ctx, lens)) + 1
    md = step_metadata(lens, ctx, block_size=block, max_len=max_len, device=dev)
    md.num_prefills = len(prefill)
    md.max_query_len = max(lens)
    caches = new_kv_cache(graph, len(lens), max_len, block, kv_cache_dtype(exe), dev)
    vocab = int(graph.meta.get("vocab_size") or 2)
    pos = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, lens)])
    feeds = {"input_ids": torch.randint(0, vocab, (sum(lens),), generator=gen).to(dev), "positions": pos.to(dev)}
    feed_last_rows(feeds, [v.name for v in graph.inputs], md)
    return feeds, md, caches


def measure(exe, feeds, md, caches, iters: int) -> dict[str, float]:  # noqa: ANN001
    issue, wall, span = [], [], []
    for i in range(iters + 2):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        exe.run(feeds, md, caches)
        t1 = time.perf_counter()
        b.record()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 2:
            issue.append((t1 - t0) * 1e3)
            wall.append((t2 - t0) * 1e3)
            span.append(a.elapsed_time(b))
    return {"issue_ms": statistics.median(issue), "wall_ms": statistics.median(wall), "span_ms": statistics.median(span)}


def kernels(exe, feeds, md, caches, reps: int = 3) -> tuple[float, list[tuple[str, float, int]]]:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            exe.run(feeds, md, caches)
        torch.cuda.synchronize()
    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by[e.name][0] += getattr(e, "device_time_total", 0.0) or e.cuda_time_total
            by[e.name][1] += 1
    total = sum(v[0] for v in by.values()) / reps / 1e3
    top = sorted(((k, v[0] / reps / 1e3, v[1] // reps) for k, v in by.items()), key=lambda r: -r[1])[:25]
    return total, top


def host_profile(exe, feeds, md, caches) -> str:  # noqa: ANN001
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    exe.run(feeds, md, caches)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    return s.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("out")
    p.add_argument("--prefill", default="1024,824", help="prefill chunk lengths of the mixed step")
    p.add_argument("--decodes", type=int, default=200)
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    import portlayer
    from portlayer.bench import kv_block_size

    loaded = portlayer.load(a.artifact)
    exe = loaded.executable()
    graph = loaded.graph
    block = kv_block_size(loaded.plan)
    gen = torch.Generator().manual_seed(0)
    pre = [int(x) for x in a.prefill.split(",") if x]
    cases = {  # "graph": a replayed graph where the program has one for the step (step graphs for prefill tokens)
        "mixed (graph)": (pre, a.decodes),
        "mixed (eager)": (pre, a.decodes),
        "prefill only (graph)": (pre, 0),
        "prefill only (eager)": (pre, 0),
        "decode only (graph)": ([], a.decodes),
        "decode only (eager)": ([], a.decodes),
    }
    out: dict[str, object] = {"artifact": a.artifact, "prefill": pre, "decodes": a.decodes, "context": a.context,
                              "gpu": torch.cuda.get_device_name(), "cases": {}}
    with torch.inference_mode():
        for name, (chunks, d) in cases.items():
            if not chunks and not d or (not chunks and name.startswith("mixed")):
                continue  # no tokens, or the decode-only cases already time it
            feeds, md, caches = case(graph, exe, chunks, d, a.context, block, gen)
            graphs = exe.use_graphs
            if "eager" in name:
                exe.use_graphs = False
            try:
                row = measure(exe, feeds, md, caches, a.iters)
                row["kernels_ms"], top = kernels(exe, feeds, md, caches)
                row["tokens"] = int(feeds["input_ids"].shape[0])
                print(f"== {name}: {row}")
                for k, ms, n in top:
                    print(f"  {ms * 1e3:9.1f} us {n:5d} x  {k[:100]}")
                row["top"] = [{"name": k, "us": round(ms * 1e3, 1), "count": n} for k, ms, n in top]
                if name in ("mixed (eager)", "prefill only (eager)"):
                    text = host_profile(exe, feeds, md, caches)
                    print(text)
                    row["host_profile"] = text
            finally:
                exe.use_graphs = graphs
            out["cases"][name] = row
            del caches
            torch.cuda.empty_cache()
    print(f"{'case':24s} {'tokens':>7s} {'issue ms':>9s} {'wall ms':>8s} {'span ms':>8s} {'kernels ms':>10s}")
    for name, r in out["cases"].items():
        print(f"{name:24s} {r['tokens']:7d} {r['issue_ms']:9.3f} {r['wall_ms']:8.3f} {r['span_ms']:8.3f} {r['kernels_ms']:10.3f}")
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
