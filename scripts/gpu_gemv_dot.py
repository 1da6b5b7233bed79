"""Decode GEMM groups on the H200: vendor path vs the few-rows kernels vs their tensor-core tier, per row count.

    python scripts/gpu_gemv_dot.py                          # H200: writes $OUT/gemv_dot_h200.json, prints a table
    TRITON_INTERPRET=1 python scripts/gpu_gemv_dot.py --smoke   # CPU: tiny shapes, one repeat (a run-through)

For the Qwen3-0.6B layer shape (hidden 1024, q 2048, kv 1024, intermediate 3072) and the 8B shape (hidden 4096,
q 4096, kv 1024, intermediate 14336), each decode GEMM group of a layer as the compiler forms it (residual add +
RMSNorm + Q|K|V with the sum stored; o-proj; residual add + RMSNorm + gate|up + silu*mul; down) is a Flat IR graph
that goes through the pipeline for nvidia-h200 (bf16), and the generated program is timed three ways at M rows
(generate()'s row-rule overrides, nothing else changes): (a) vendor: the norm kernel, torch.mm per linear (cuBLAS)
and the silu*mul kernel, as today above tuning.gemv_max_tokens; (b) the CUDA-core few-rows kernels (one launch per
group); (c) their tensor-core tier (tl.dot, one launch per group). The weights are cycled past the 50 MB L2: the
graph holds C copies of the group (own weights and inputs, C * weight bytes >= 150 MB), one forward runs them
in turn; a CUDA graph of several forwards is replayed and timed with CUDA events, median of the repeats, divided
by C. gemv_max_weight_mib is raised in the timed descriptor so 8B's 117 MB gate/up/down reach the few-rows
kernels too (the shipped 64 MiB keeps them on cuBLAS at every row count: they are left out of the crossover).
Each (b) and (c) output is compared with (a)'s (bf16: the check the CPU interpreter cannot make).

The crossover printed last: the largest M such that (c) beats (a) for every group under the shipped weight cap
at every row count from 2 to M: the value for tuning.gemv_dot_max_tokens.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _bootstrap import bootstrap  # noqa: E402

bootstrap()

import torch  # noqa: E402

SHAPES = {"qwen3-0.6b": dict(hidden=1024, q=2048, kv=1024, inter=3072),
          "llama-8b": dict(hidden=4096, q=4096, kv=1024, inter=14336)}
SMOKE_SHAPES = {"tiny": dict(hidden=64, q=64, kv=32, inter=96)}
GROUPS = ("qkv", "o", "gate_up", "down")
L2_BYTES = 150e6  # 3 x the H200's 50 MB L2


def _weights_of(group: str, s: dict[str, int]) -> list[tuple[int, int]]:
    h = s["hidden"]
    return {"qkv": [(s["q"], h), (s["kv"], h), (s["kv"], h)], "o": [(h, s["q"])],
            "gate_up": [(s["inter"], h), (s["inter"], h)], "down": [(h, s["inter"])]}[group]


def _graph(group: str, s: dict[str, int], copies: int, dtype: torch.dtype):
    """``copies`` independent copies of one decode group (own inputs and weights: no two share a launch)."""
    from portlayer.flatten.ir import GraphBuilder, TensorType

    dt = str(dtype).replace("torch.", "")
    gen = torch.Generator().manual_seed(len(group))
    b = GraphBuilder()
    outs = []
    for c in range(copies):
        ws = _weights_of(group, s)
        k = ws[0][1]
        x = b.add_input(f"x{c}", TensorType(dt, ("num_tokens", k)))
        if group in ("o", "down"):
            w = (torch.randn(ws[0], generator=gen) / k**0.5).to(dtype)
            outs.append(b.add1("linear", [x, b.add_param(f"w{c}", w)]))
            continue
        r = b.add_input(f"r{c}", TensorType(dt, ("num_tokens", k)))
        h = b.add1("add", [x, r])
        y = b.add1("rms_norm", [h, b.add_param(f"nw{c}", (0.5 + torch.rand(k, generator=gen)).to(dtype))], {"eps": 1e-6})
        lin = [b.add1("linear", [y, b.add_param(f"w{c}_{i}", (torch.randn(n, kk, generator=gen) / kk**0.5).to(dtype))])
               for i, (n, kk) in enumerate(ws)]
        outs += (lin if group == "qkv" else [b.add1("mul", [b.add1("silu", [lin[0]]), lin[1]])]) + [h]
    b.graph.outputs = outs
    return b.graph


def _target(tmp: Path) -> Path:
    """nvidia-h200 with the weight cap lifted (every group reaches the few-rows kernels when asked)."""
    from portlayer.capabilities.descriptor import load_descriptor

    raw = copy.deepcopy(dict(load_descriptor("nvidia-h200").raw))
    raw["tuning"]["gemv_max_weight_mib"] = 4096
    path = tmp / "nvidia-h200-uncapped.json"
    path.write_text(json.dumps(raw))
    return path


def _time(fn, reps: int, device: str) -> float:
    """Milliseconds per call: a CUDA graph of ``inner`` calls replayed ``reps`` times, median (CPU: one call)."""
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    inner = 4
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()  # compiles every kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one repeat (CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--rows", default=None, help="comma-separated row counts (default 1,2,4,8,16,32,64,128)")
    ap.add_argument("--shapes", default=None, help=f"comma-separated subset of {', '.join(SHAPES)}")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tier-stages", default="", help="also time the tier with these launch.gemv num_stages (e.g. 3)")
    ap.add_argument("--json", default=None, help="default $OUT/gemv_dot_h200.json (or ./gemv_dot_h200.json)")
    args = ap.parse_args(argv)
    from portlayer.backends.generate import generate
    from portlayer.codegen.host_support import StepState
    from portlayer.codegen.program import load_program, write_program
    from portlayer.passes.pipeline import run_pipeline

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16  # the interpreter has no bfloat16 tl.dot
    rows = [int(r) for r in (args.rows or ("1,16" if args.smoke else "1,2,4,8,16,32,64,128")).split(",")]
    shapes = SMOKE_SHAPES if args.smoke else {k: SHAPES[k] for k in (args.shapes.split(",") if args.shapes else SHAPES)}
    reps = 1 if args.smoke else args.reps
    variants = {"vendor": (0, 0, None), "cuda_cores": (max(rows), 0, None), "tensor_cores": (0, max(rows), None)}
    for st_ in [int(x) for x in args.tier_stages.split(",") if x]:
        variants[f"tensor_cores_s{st_}"] = (0, max(rows), st_)
    from portlayer.capabilities.descriptor import load_descriptor

    cap = float(load_descriptor("nvidia-h200").tuning.get("gemv_max_weight_mib", 0)) * 2**20
    out: dict = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)", "dtype": str(dtype),
                 "rows": rows, "shipped_gemv_max_weight_mib": cap / 2**20, "results": []}
    json_path = Path(args.json or Path(os.environ.get("OUT", ".")) / "gemv_dot_h200.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        target = str(_target(tmp))
        for sname, s in shapes.items():
            for group in GROUPS:
                ws = _weights_of(group, s)
                wbytes = sum(n * k for n, k in ws) * torch.tensor([], dtype=dtype).element_size()
                copies = 2 if args.smoke else max(2, -(-int(L2_BYTES) // wbytes))
                graph = _graph(group, s, copies, dtype)
                res = run_pipeline(graph, target, overrides={"compute_dtype": str(dtype).replace("torch.", ""),
                                                             "weight_quantization": "none"})
                progs = {}
                for v, (gemv, dot, stages) in variants.items():
                    launch = {"gemv": {**res.plan.launch_configs["gemv"], "num_stages": stages}} if stages else None
                    gen = generate(res.graph, res.plan, res.descriptor, gemv_max_tokens=gemv, gemv_dot_max_tokens=dot,
                                   launch=launch)
                    write_program(gen, tmp / f"{sname}-{group}-{v}")
                    progs[v] = load_program(tmp / f"{sname}-{group}-{v}", res.graph.weights, device,
                                            max_seqs=max(rows), use_graphs=False)
                under_cap = cap <= 0 or max(n * k for n, k in ws) * 2 <= cap
                for m in rows:
                    g = torch.Generator().manual_seed(m)
                    feeds = {v.name: torch.randn(m, v.type.shape[1], generator=g).to(dtype).to(device)
                             for v in res.graph.inputs}
                    st = StepState.build(None, m, torch.device(device), None)
                    row = {"shape": sname, "group": group, "rows": m, "weight_mb": round(wbytes / 1e6, 2),
                           "copies": copies, "under_shipped_cap": under_cap}
                    ref = None
                    for v, prog in progs.items():
                        outs = [o.clone() for o in prog.forward(m, m, feeds, st, None)]
                        ref = outs if ref is None else ref
                        if v != "vendor":
                            row[f"{v}_rel_err"] = max(_rel(o, r) for o, r in zip(outs, ref))
                        ms = _time(lambda prog=prog, m=m, feeds=feeds, st=st: prog.forward(m, m, feeds, st, None),
                                   reps, device) / copies
                        row[f"{v}_us"] = round(ms * 1e3, 2)
                    row["read_floor_us"] = round(wbytes / 4.8e12 * 1e6, 2)
                    out["results"].append(row)
                    print(json.dumps(row), flush=True)
                json_path.write_text(json.dumps(out, indent=1) + "\n")
    out["crossover"] = _crossover(out["results"], rows)
    out["wall_s"] = round(time.time() - start, 1)
    json_path.write_text(json.dumps(out, indent=1) + "\n")
    _table(out)
    return 0


def _crossover(results: list[dict], rows: list[int]) -> dict:
    """Largest M with (c) faster than (a) for every group under the shipped cap at every row count in 2..M."""
    best, largest, contiguous = 0, 0, True
    for m in sorted(r for r in rows if r >= 2):
        cells = [r for r in results if r["rows"] == m and r["under_shipped_cap"]]
        wins = bool(cells) and all(r["tensor_cores_us"] < r["vendor_us"] for r in cells)
        largest = m if wins else largest
        contiguous = contiguous and wins
        best = m if contiguous else best
    worst = max((r.get("tensor_cores_rel_err", 0.0) for r in results), default=0.0)
    return {"gemv_dot_max_tokens": best, "largest_winning_rows": largest, "worst_tensor_core_rel_err": worst,
            "rows_between_measured_points": "the value is a measured row count; the rule holds up to the next one "
                                            "only if it is re-measured there"}


def _table(out: dict) -> None:
    print(f"\n{out['gpu']}, {out['dtype']}: us per group (a: vendor = norm + torch.mm per linear + silu*mul; "
          "b: few-rows CUDA cores; c: tensor-core tier), weights cycled past L2")
    print(f"{'shape':<11} {'group':<8} {'MB':>6} {'rows':>5} {'a vendor':>9} {'b cuda':>9} {'c dot':>9} "
          f"{'c/a':>6} {'floor':>6} {'err c':>8}")
    for r in out["results"]:
        mark = "".join(f"  {k[:-3]} {v}" for k, v in r.items() if k.startswith("tensor_cores_s") and k.endswith("_us"))
        mark += "" if r["under_shipped_cap"] else "  (above the shipped weight cap: vendor at every row count)"
        print(f"{r['shape']:<11} {r['group']:<8} {r['weight_mb']:>6} {r['rows']:>5} {r['vendor_us']:>9} "
              f"{r['cuda_cores_us']:>9} {r['tensor_cores_us']:>9} {r['tensor_cores_us'] / r['vendor_us']:>6.2f} "
              f"{r['read_floor_us']:>6} {r['tensor_cores_rel_err']:>8.1e}{mark}")
    c = out["crossover"]
    print(f"\ncrossover: tuning.gemv_dot_max_tokens = {c['gemv_dot_max_tokens']} (the tier beats the vendor path for "
          f"every group under the shipped weight cap at every measured row count from 2 to it; largest winning row "
          f"count {c['largest_winning_rows']}); worst tensor-core rel err vs the vendor path "
          f"{c['worst_tensor_core_rel_err']:.1e}; {out['wall_s']} s")


if __name__ == "__main__":
    sys.exit(main())
