"""Where a waited, replayed decode step spends its time, timed without the profiler (which lists no kernels
inside a replayed CUDA graph under torch 2.11): issue 19's missing host term and issue 12's replay path.

    python scripts/gpu_replay_timeline.py ART [ART ...] [--batches 1,16,64] [--context 128] [--synthetic]

Per artifact and batch (one JSON line each, then "TIMELINE [...]"):
- ``wall_us``: ``run()`` + synchronize, median of 200 (what `portlayer bench` times);
- ``pre_replay_us`` / ``replay_call_us`` / ``post_replay_us``: host time inside ``run()`` before the graph's
  ``replay()``, in the call, and after it (the output copies), on an idle device;
- ``busy_replay_call_us``: the same call while the device is still busy with a 2 ms sleep kernel queued first
  (host submission alone, nothing to wait for);
- ``device_us``: CUDA events around ``run()`` queued behind that sleep (the step's device time when the host is
  ahead: copies, the graph, the output copy);
- ``serial_us`` = wall - device: what the host adds to a waited step;
- ``kernels``: device kernels (and memcpy/memset) of one eager forward at that batch, from torch.profiler,
  counted after every timing (a process that has run the profiler launches slower from then on).
``--lines`` times the replay path statement by statement (session 9's code: each input copy, each pad
fill, the view slicing) and a ``torch._foreach_copy_`` alternative.
``--synthetic`` adds graphs of N tiny kernels (torch ``add_`` and a Triton kernel of 16 pointer arguments):
the host cost of ``replay()`` per node, idle and busy, and the waited wall.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def _median_us(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e6, 1)


class _Timed:
    """Wraps a CUDAGraph so run() can be split around its replay() call."""

    def __init__(self, graph: Any) -> None:
        self.graph, self.t0, self.t1 = graph, 0.0, 0.0

    def replay(self) -> None:
        self.t0 = time.perf_counter()
        self.graph.replay()
        self.t1 = time.perf_counter()


def _kernels(exe: Any, b: int, caches: Any, torch: Any) -> int:
    st, feeds = exe.graph_step_state(b, caches)
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        exe.forward(b, b, feeds, st, caches)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _loaded(path: str) -> tuple[Any, Any, int, Any]:
    """(the loaded artifact, its program, its KV block size, a seeded generator for decode_step)."""
    import torch

    import portlayer
    from portlayer.bench import kv_block_size

    loaded = portlayer.load(path)
    return loaded, loaded.executable(), kv_block_size(loaded.plan), torch.Generator().manual_seed(0)


def artifact_rows(path: str, batches: list[int], context: int) -> list[dict[str, Any]]:
    import torch

    from portlayer.backends.calibration_runner import device_behind_sleep
    from portlayer.bench import decode_step

    loaded, exe, block, g = _loaded(path)
    rows = []
    for b in batches:
        fd, md, caches = decode_step(loaded.graph, exe, b, context, block, g)
        with torch.inference_mode():
            for _ in range(10):
                exe.run(fd, md, caches)
            torch.cuda.synchronize()
            key = (next(s for s in exe.capture_sizes if s >= b), exe._cache_pointers(caches))  # this step's graph
            graph, outs = exe._graphs[key]
            timed = _Timed(graph)
            exe._graphs[key] = (timed, outs)
            walls, pre, call, post = [], [], [], []
            for _ in range(200):
                t0 = time.perf_counter()
                exe.run(fd, md, caches)
                t2 = time.perf_counter()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
                pre.append(timed.t0 - t0)
                call.append(timed.t1 - timed.t0)
                post.append(t2 - timed.t1)
            busy_call: list[float] = []

            def busy(fd: Any = fd, md: Any = md, caches: Any = caches, timed: _Timed = timed,
                     busy_call: list[float] = busy_call) -> None:
                exe.run(fd, md, caches)  # queued behind a ~2 ms sleep kernel: the host runs ahead of the device
                busy_call.append(timed.t1 - timed.t0)

            device = round(device_behind_sleep(busy, torch.device("cuda"), 100), 1)
            exe._graphs[key] = (graph, outs)
        wall = _median_us(walls)
        rows.append({"artifact": path, "batch": b, "graph_batch": key[0], "context": context, "wall_us": wall,
                     "pre_replay_us": _median_us(pre), "replay_call_us": _median_us(call),
                     "post_replay_us": _median_us(post), "busy_replay_call_us": _median_us(busy_call),
                     "device_us": device, "serial_us": round(wall - device, 1), "kv_layers": len(caches)})
        print(json.dumps(rows[-1]), flush=True)
        last_caches = caches
    # after every timing: torch.profiler leaves CUPTI subscribed, and every later CUDA call in the process
    # pays for it (session 10: the replay call went from 19 to 235 us, the copies before it +40%)
    for row in rows:
        row["kernels"] = _kernels(exe, row["graph_batch"], last_caches, torch)
    print(json.dumps([{"batch": r["batch"], "kernels": r["kernels"]} for r in rows]), flush=True)
    return rows


def line_rows(path: str, batches: list[int], context: int) -> list[dict[str, Any]]:
    """Each statement of session 9's HostProgram._replay timed on its own (a copy of that body with a clock
    between; the measurement behind session 10's change, which slices once per size and pads only when needed)."""
    import torch

    from portlayer.bench import decode_step

    loaded, exe, block, g = _loaded(path)
    rows = []
    for T in batches:  # noqa: N806
        feeds, meta, kv = decode_step(loaded.graph, exe, T, context, block, g)
        with torch.inference_mode():
            for _ in range(5):
                exe.run(feeds, meta, kv)
            torch.cuda.synchronize()
            marks: dict[str, list[float]] = {}
            for _ in range(200):
                t = [("start", time.perf_counter())]
                exe._graphable(T, meta, kv)
                t.append(("graphable", time.perf_counter()))
                B = next(s for s in exe.capture_sizes if s >= T)  # noqa: N806
                s = exe._static_state(kv)
                t.append(("bucket+static", time.perf_counter()))
                for k in exe.INPUTS:
                    s.feeds[k][:T].copy_(feeds[k], non_blocking=True)
                t.append((f"feeds x{len(exe.INPUTS)}", time.perf_counter()))
                s.slots[:T].copy_(meta.slot_mapping, non_blocking=True)
                t.append(("slots", time.perf_counter()))
                s.slots[T:B].fill_(-1)
                t.append(("slots pad", time.perf_counter()))
                s.seq_lens[:T].copy_(meta.seq_lens, non_blocking=True)
                t.append(("seq_lens", time.perf_counter()))
                s.seq_lens[T:B].fill_(0)
                t.append(("seq_lens pad", time.perf_counter()))
                w = meta.block_tables.shape[1]
                s.block_tables[:T, :w].copy_(meta.block_tables, non_blocking=True)
                t.append(("block_tables", time.perf_counter()))
                key = (B, tuple(c.data_ptr() for pair in kv for c in pair))
                graph, outs = exe._graphs[key]
                t.append(("key", time.perf_counter()))
                graph.replay()
                t.append(("replay", time.perf_counter()))
                res = [o[:T].clone() for o in outs]
                t.append((f"clone x{len(outs)}", time.perf_counter()))
                torch.cuda.synchronize()
                t.append(("wait", time.perf_counter()))
                # the candidates: one foreach copy for the 1-D inputs, a view cached per size
                dsts = [s.feeds[k][:T] for k in exe.INPUTS] + [s.slots[:T], s.seq_lens[:T]]
                t.append(("alt: views", time.perf_counter()))
                torch._foreach_copy_(dsts, [feeds[k] for k in exe.INPUTS] + [meta.slot_mapping, meta.seq_lens])
                t.append(("alt: foreach_copy", time.perf_counter()))
                torch.cuda.synchronize()
                t.append(("alt: wait", time.perf_counter()))
                for (_, a), (name, b) in zip(t, t[1:]):
                    marks.setdefault(name, []).append(b - a)
                del res
        row = {"artifact": path, "batch": T, **{k: _median_us(v) for k, v in marks.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def cublas_rows() -> list[dict[str, Any]]:
    """The host cost of replaying a graph of N vendor GEMMs (torch.mm at 16 rows): idle and busy."""
    import torch

    rows = []
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    for m in (1, 16):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, 1024, device="cuda", dtype=torch.bfloat16)
        for n in (32, 128):
            def body(n: int = n, x: Any = x, y: Any = y) -> None:
                for _ in range(n):
                    torch.mm(x, w.t(), out=y)

            body()
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                body()
            for _ in range(5):
                gr.replay()
            torch.cuda.synchronize()
            idle, busy = [], []
            for _ in range(50):
                t0 = time.perf_counter()
                gr.replay()
                idle.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                torch.cuda._sleep(4_000_000)
                t0 = time.perf_counter()
                gr.replay()
                busy.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
            rows.append({"synthetic": f"cublas_mm_m{m}", "nodes": n, "replay_call_us": _median_us(idle),
                         "busy_replay_call_us": _median_us(busy)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def synthetic_rows() -> list[dict[str, Any]]:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def many_args(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(a0 + offs, mask=m) + tl.load(a1 + offs, mask=m)
        tl.store(a15 + offs, x, mask=m)

    rows = []
    bufs = [torch.zeros(64, device="cuda") for _ in range(16)]
    for kind in ("torch_add", "triton_16_args"):
        for n in (32, 128, 512):
            x = torch.zeros(1, device="cuda")

            def body(x: Any = x, n: int = n, kind: str = kind) -> None:
                for _ in range(n):
                    if kind == "torch_add":
                        x.add_(1)
                    else:
                        many_args[(1,)](*bufs, 64, BLOCK=64)

            body()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body()
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
            idle, walls, busy, dev = [], [], [], []
            for _ in range(50):
                t0 = time.perf_counter()
                g.replay()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
                idle.append(t1 - t0)
            for _ in range(50):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(4_000_000)
                e0.record()
                t0 = time.perf_counter()
                g.replay()
                busy.append(time.perf_counter() - t0)
                e1.record()
                torch.cuda.synchronize()
                dev.append(e0.elapsed_time(e1) / 1e3)
            rows.append({"synthetic": kind, "nodes": n, "replay_call_us": _median_us(idle),
                         "busy_replay_call_us": _median_us(busy), "wall_us": _median_us(walls),
                         "device_us": _median_us(dev)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("artifacts", nargs="*")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--synthetic", action="store_true")
    p.add_argument("--lines", action="store_true")
    a = p.parse_args()
    rows = []
    if a.synthetic:
        rows += synthetic_rows() + cublas_rows()
    for art in a.artifacts:
        batches = [int(x) for x in a.batches.split(",")]
        try:  # one artifact that fails (session 10: tiny-qwen3 after the 0.6B shape, error not kept) costs its rows only
            rows += line_rows(art, batches, a.context) if a.lines else artifact_rows(art, batches, a.context)
        except Exception as e:  # noqa: BLE001 - a diagnosis script: report and go on
            print(json.dumps({"artifact": art, "error": f"{type(e).__name__}: {e}"}), flush=True)
    print("TIMELINE " + json.dumps(rows))


if __name__ == "__main__":
    main()
