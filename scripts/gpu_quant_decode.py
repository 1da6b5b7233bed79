"""Weight-only int8 / int4 decode against bf16 on the Qwen3-0.6B shape (issue 12, lever 6), one device call.

    bash scripts/gpu_quant_decode.sh          # or: PYTHONPATH=. python scripts/gpu_quant_decode.py

For each of bf16, int8, int4: the 0.6B shape with seeded random bf16 weights
(benchmarks/bench_serving.build_model) compiled for nvidia-h200 (``portlayer.compile(quantize=...)``),
``portlayer bench`` decode at batch 1 / 16 / 64 with 512 cached tokens, the CUDA kernels one decode step
launches at batch 1 and 64 and their device time (torch.profiler, counted by this script), and ``portlayer validate`` on the int8 and
int4 artifacts. int4 is quantized round-to-nearest (``--int4-method``, default rtn): the calibrated
default (clip) runs a sequential calibration on the CPU that takes minutes on this shape, and the
method changes the integers, not the kernels being timed. Writes ``$OUT/quant_decode_h200.json``
after every stage (a run cut short keeps what it measured), with ms/step and the int8/bf16 and
int4/bf16 speed ratios (bf16 ms / quantized ms: above 1 is faster than bf16; issue 12's goal is
int4 at batch 1 >= 1.6). Each compile quantizes and grades 0.6 B parameters on the CPU; if one call
runs long, split it: ``--modes none,int4`` then ``--modes int8 --json $OUT/quant_decode_h200_int8.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import torch  # noqa: E402
from bench_serving import build_model  # noqa: E402  (bootstraps `import portlayer` from the checkout)


def _launches(loaded: Any, batch: int, context: int, steps: int = 5) -> dict[str, Any]:
    """CUDA kernels per decode step at ``batch`` rows (torch.profiler device events / steps)."""
    from torch.profiler import ProfilerActivity, profile

    from portlayer.codegen.host_support import kv_cache_dtype
    from portlayer.flatten.logits import feed_last_rows
    from portlayer.runtime.validation import new_kv_cache, step_metadata

    exe, graph = loaded.executable(), loaded.graph
    dev = torch.device(exe.device)
    block = int(loaded.plan.value("kv_block_size") or 16) if "kv_block_size" in loaded.plan.names() else 16
    caches = new_kv_cache(graph, batch, context + 1, block, kv_cache_dtype(exe), dev)
    md = step_metadata([1] * batch, [context] * batch, block_size=block, max_len=context + 1, device=dev)
    fd = {"input_ids": torch.randint(0, int(graph.meta.get("vocab_size") or 2), (batch,)).to(dev),
          "positions": torch.full((batch,), context, dtype=torch.int64, device=dev)}
    feed_last_rows(fd, [v.name for v in graph.inputs], md)
    with torch.inference_mode():
        for _ in range(3):
            exe.run(fd, md, caches)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                exe.run(fd, md, caches)
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower() and "memset" not in e.name.lower():
            kernels.setdefault(e.name, []).append(e.time_range.elapsed_us())
    total = sum(len(v) for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {"batch": batch, "launches_per_step": total / steps,
            "device_us_per_step": round(sum(sum(v) for v in kernels.values()) / steps, 1),
            "top": [{"kernel": k[:90], "launches_per_step": len(v) / steps, "us_per_launch": round(sum(v) / len(v), 2)}
                    for k, v in top]}


def _validate(art: Path, timeout: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "portlayer.cli", "validate", str(art)], capture_output=True, text=True,
                           timeout=timeout, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        rc, tail = p.returncode, (p.stdout + p.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        rc, tail = 124, f"validate ran past {timeout} s"
    return {"rc": rc, "ok": rc == 0, "s": round(time.perf_counter() - t0, 1), "tail": tail}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="none,int4,int8")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--int4-method", default="rtn", help="passes/quantize.py method for int4 (rtn, clip, gptq, awq)")
    p.add_argument("--work", default="/tmp/quant_decode")
    p.add_argument("--no-validate", action="store_true")
    p.add_argument("--json", default=None, help="default: $OUT/quant_decode_h200.json, else ./quant_decode_h200.json")
    args = p.parse_args(argv)

    import portlayer
    from portlayer.bench import bench
    from portlayer.passes import quantize as qpass

    qpass.DEFAULT_METHOD[4] = args.int4_method  # the method that makes the integers; the kernels are what is timed
    out = Path(args.json or Path(os.environ.get("OUT", ".")) / "quant_decode_h200.json")
    batches = [int(b) for b in args.batches.split(",") if b]
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
                           "torch": torch.__version__, "shape": "Qwen3-0.6B", "layers": args.layers, "vocab": args.vocab,
                           "context": args.context, "int4_method": args.int4_method, "modes": {}}

    def write() -> None:
        step = {m: {d["batch"]: d["step_ms"] for d in r.get("bench", {}).get("decode", [])} for m, r in res["modes"].items()}
        base = step.get("none", {})
        res["step_ms"] = step
        res["speedup_vs_bf16"] = {m: {b: round(base[b] / v, 3) for b, v in s.items() if b in base}
                                  for m, s in step.items() if m != "none"}
        out.write_text(json.dumps(res, indent=1) + "\n")

    t_all = time.perf_counter()
    for mode in [m for m in args.modes.split(",") if m]:
        r: dict[str, Any] = {}
        res["modes"][mode] = r
        art = Path(args.work) / f"art_{mode}"
        try:
            t0 = time.perf_counter()
            model = build_model(args.layers, args.vocab, 0)
            portlayer.compile(model, target="nvidia-h200", output=art, progress=False,
                              quantize=None if mode == "none" else mode)
            del model
            r["compile_s"] = round(time.perf_counter() - t0, 1)
            loaded = portlayer.load(art)
            r["bench"] = bench(loaded, prefill_tokens=128, context=args.context, batch_sizes=batches, iters=args.iters)
            print(f"[quant] {mode}: compile {r['compile_s']} s; decode " + ", ".join(
                f"b{d['batch']} {d['step_ms']:.3f} ms" for d in r["bench"]["decode"]), flush=True)
            write()
            for b in (1, max(batches)):
                r[f"profile_b{b}"] = p = _launches(loaded, b, args.context)
                print(f"[quant] {mode}: b{b} {p['launches_per_step']} launches/step, {p['device_us_per_step']} us of "
                      "kernels; top: " + "; ".join(f"{t['kernel'][:40]} {t['launches_per_step']}x{t['us_per_launch']}us"
                                                   for t in p["top"][:5]), flush=True)
                write()
            del loaded
            torch.cuda.empty_cache()
            if mode != "none" and not args.no_validate:
                r["validate"] = _validate(art, 120)
                print(f"[quant] {mode}: validate rc={r['validate']['rc']} in {r['validate']['s']} s\n"
                      + r["validate"]["tail"][-600:], flush=True)
        except Exception as e:  # keep the other modes' figures
            r["error"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"[quant] {mode}: {r['error']}", flush=True)
        write()
    res["total_s"] = round(time.perf_counter() - t_all, 1)
    write()
    print(json.dumps({"step_ms": res["step_ms"], "speedup_vs_bf16": res["speedup_vs_bf16"]}, indent=1))
    print(f"[quant] wrote {out} in {res['total_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
