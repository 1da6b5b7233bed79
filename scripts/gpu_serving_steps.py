"""Where bench_serving's 256-sequence workload spends its time, by kind of step: decode-only steps (by batch) and
steps with prefill tokens (by token count), the wall time between engine steps, and - with ``--profile`` - the
device time of the kernels over the whole run (torch.profiler), so host-bound and device-bound steps can be told
apart. A diagnosis script: it prints tables and writes JSON, it asserts nothing.

    python scripts/gpu_serving_steps.py ARTIFACT out.json [--profile]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _bootstrap import bootstrap  # noqa: E402

bootstrap()

import torch  # noqa: E402


def bucket(n: int) -> str:
    for hi in (1, 16, 64, 128, 192, 256, 512, 1024, 2048, 4096):
        if n <= hi:
            return f"<={hi}"
    return ">4096"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("out")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--num-seqs", type=int, default=256)
    a = p.parse_args()
    from bench_serving import run_serving

    from portlayer.runtime.engine import LLMEngine

    t0 = time.perf_counter()
    eng = LLMEngine.from_artifact(a.artifact, enable_prefix_caching=False)
    exe = eng.executable
    load_s = time.perf_counter() - t0
    print(f"engine loaded in {load_s:.2f} s ({len(getattr(exe, '_graphs', {}))} CUDA graphs captured)")
    shapes: list[tuple[int, int, int]] = []
    issues: list[float] = []  # host time inside exe.run (launching the step), per step
    prepares: list[float] = []  # host time building the step's inputs (ModelRunner.prepare)
    inner, prep = exe.run, eng.runner.prepare

    def run(feeds, meta, kv):  # noqa: ANN001, ANN202 - records each step's composition
        first = next(iter(feeds.values()))
        t = int(first.shape[0]) if first.dim() else 0
        n = int(meta.seq_lens.shape[0]) if meta is not None else 0
        pre = int(meta.num_prefills) if meta is not None else 0
        shapes.append((t, n, pre))
        t0 = time.perf_counter()
        out = inner(feeds, meta, kv)
        issues.append(time.perf_counter() - t0)
        return out

    def prepare(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        out = prep(*args, **kwargs)
        prepares.append(time.perf_counter() - t0)
        return out

    exe.run = run
    eng.runner.prepare = prepare
    walls: list[float] = []
    step = eng.step

    def timed_step():  # noqa: ANN202
        t0 = time.perf_counter()
        out = step()
        walls.append(time.perf_counter() - t0)
        return out

    eng.step = timed_step
    args = argparse.Namespace(seed=0, min_len=100, max_len=1024, num_seqs=a.num_seqs, time_limit=float("inf"))
    prof = None
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()
    res = run_serving(eng, args)
    after = torch.cuda.memory_stats()
    # allocator retries (a cudaFree of cached blocks and a retry: each synchronises the device) and cudaMalloc calls
    # during serving: an eager step that allocates can stall the host while the previous step still runs
    memory = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}
    memory.update(reserved_gib=round(after.get("reserved_bytes.all.current", 0) / 2**30, 2),
                  peak_allocated_gib=round(after.get("allocated_bytes.all.peak", 0) / 2**30, 2))
    print(f"allocator during serving: {memory}")
    if prof is not None:
        prof.__exit__(None, None, None)
    kinds: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for (t, n, pre), w, iss, prp in zip(shapes, walls, issues, prepares):
        kinds[f"decode b{bucket(n)}" if pre == 0 else f"mixed {bucket(t)} tokens"].append((w, iss, prp))
    rows = [{"kind": k, "steps": len(v), "seconds": round(sum(x[0] for x in v), 3),
             "mean_ms": round(1e3 * sum(x[0] for x in v) / len(v), 3),
             "median_ms": round(1e3 * sorted(x[0] for x in v)[len(v) // 2], 3),
             "max_ms": round(1e3 * max(x[0] for x in v), 3),
             "issue_ms": round(1e3 * sum(x[1] for x in v) / len(v), 3),
             "prepare_ms": round(1e3 * sum(x[2] for x in v) / len(v), 3)}
            for k, v in sorted(kinds.items(), key=lambda kv: -sum(x[0] for x in kv[1]))]
    print(json.dumps(res))
    print(f"{'kind':28s} {'steps':>6s} {'seconds':>8s} {'mean ms':>8s} {'median':>8s} {'max':>8s} {'issue ms':>9s} "
          f"{'prepare ms':>10s}")
    for r in rows:
        print(f"{r['kind']:28s} {r['steps']:6d} {r['seconds']:8.3f} {r['mean_ms']:8.3f} {r['median_ms']:8.3f} "
              f"{r['max_ms']:8.3f} {r['issue_ms']:9.3f} {r['prepare_ms']:10.3f}")
    out = {"serving": res, "memory": memory, "steps": rows, "run_calls": len(shapes), "engine_steps": len(walls), "load_s": round(load_s, 2),
           "graphs": len(getattr(exe, "_graphs", {}))}
    if prof is not None:
        by = defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                by[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                by[e.name][1] += 1
        total = sum(v[0] for v in by.values())
        top = sorted(by.items(), key=lambda kv: -kv[1][0])[:30]
        print(f"device kernels: {total / 1e3:.1f} ms over the {res['seconds']} s run")
        for name, (us, n) in top:
            print(f"  {us / 1e3:9.2f} ms {n:7d} x {us / max(n, 1):8.2f} us  {name[:90]}")
        out["kernels_ms"] = round(total / 1e3, 1)
        out["top_kernels"] = [{"name": k, "ms": round(v[0] / 1e3, 2), "count": v[1]} for k, v in top]
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
