"""One waited decode step of a compiled artifact split into kernels, gaps between them and host time outside
them (issue 19: the cost model's missing host share; issue 12: what a step spends besides kernels).

    python scripts/gpu_step_split.py ART [--batches 1,16,64] [--context 128]

For each batch: the step's wall time as `portlayer bench` takes it (exe.run + synchronize, median of 50), then
20 steps under torch.profiler: the device kernels sorted by start and cut into steps where the device idles for
more than 30 us; per step the kernel sum, the device span (first start to last end: the kernels plus the gaps
between them) and wall - span (host time no kernel hides). Prints one line "STEPSPLIT {json}".
Under torch 2.11 on the H200 the profiler showed no kernels inside a replayed CUDA graph (one event per step):
there only wall_us and run_returns_us (the host time before run() returns) mean anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    import torch

    import portlayer
    from portlayer.bench import decode_step, kv_block_size

    p = argparse.ArgumentParser()
    p.add_argument("artifact")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=128)
    a = p.parse_args()
    loaded = portlayer.load(a.artifact)
    exe = loaded.executable()
    graph = loaded.graph
    dev = torch.device(exe.device)
    block = kv_block_size(loaded.plan)
    g = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for b in [int(x) for x in a.batches.split(",")]:
        fd, md, caches = decode_step(graph, exe, b, a.context, block, g)
        with torch.inference_mode():
            for _ in range(10):
                exe.run(fd, md, caches)
            sync()
            walls, returns = [], []
            for _ in range(50):
                t0 = time.perf_counter()
                exe.run(fd, md, caches)
                returns.append(time.perf_counter() - t0)
                sync()
                walls.append(time.perf_counter() - t0)
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(20):
                    exe.run(fd, md, caches)
                    sync()
        ks = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
        steps, cur, last_end = [], [], 0
        for s, e in ks:
            if cur and s - last_end > 30:
                steps.append(cur)
                cur = []
            cur.append((s, e))
            last_end = max(last_end, e) if len(cur) > 1 else e
        if cur:
            steps.append(cur)
        per = [(sum(e - s for s, e in st), max(e for _, e in st) - st[0][0], len(st)) for st in steps]
        wall = statistics.median(walls) * 1e6
        if not per:  # no device kernels seen (a CPU artifact): the wall time only
            rows.append({"batch": b, "context": a.context, "wall_us": round(wall, 1)})
            print(json.dumps(rows[-1]), flush=True)
            continue
        ksum = statistics.median(x[0] for x in per)
        span = statistics.median(x[1] for x in per)
        rows.append({"batch": b, "context": a.context, "wall_us": round(wall, 1),
                     "run_returns_us": round(statistics.median(returns) * 1e6, 1), "steps_seen": len(per),
                     "kernels_per_step": statistics.median(x[2] for x in per), "kernel_sum_us": round(ksum, 1),
                     "span_us": round(span, 1), "gaps_in_span_us": round(span - ksum, 1),
                     "host_outside_span_us": round(wall - span, 1)})
        print(json.dumps(rows[-1]), flush=True)
    print("STEPSPLIT " + json.dumps(rows))


if __name__ == "__main__":
    main()
