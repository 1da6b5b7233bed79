"""``portlayer compile | validate | bench | cache``: build artifacts, check them here, time them."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compile", help="compile a model into an artifact directory",
                       description="Capture MODEL, run the passes for the target, generate code, and write a verified "
                                   "artifact (to -o DIR, else the content-addressed cache).")
    p.add_argument("model", help="local HF directory, or a built-in name such as tiny-qwen3 or all-minilm-l6-v2")
    p.add_argument("--target", default="auto", help="descriptor name, 'auto' (best device here) or path.json")
    p.add_argument("-o", "--output", default=None, metavar="DIR", help="write the artifact here (default: the cache)")
    p.add_argument("--dtype", default=None, help="force the compute dtype (float32, bfloat16, float16)")
    p.add_argument("--quantize", default=None, choices=("none", "int8", "int4", "native"),
                   help="weight-only quantization (native: keep a GGUF file's Q8_0/Q4_0/Q4_1 blocks)")
    p.add_argument("--kv-cache-dtype", default=None, metavar="DTYPE",
                   help="the KV cache's element type: float8_e4m3fn (fp8) where the descriptor's kernels read it "
                        "(twice the tokens a GiB, lossy), else the compute dtype (the default)")
    p.add_argument("--strict", action="store_true", help="refuse a --quantize format below the quality gate (docs/quantization.md)")
    p.add_argument("--tensor-parallel", default=None, metavar="N|auto",
                   help="shard over N ranks (torch.distributed; auto: the smallest N that fits), docs/parallel.md")
    p.add_argument("--calibration-device", default=None, metavar="DEV",
                   help="where --quantize int8/int4 calibrates and runs the quality gate (default cpu; cuda on a GPU host)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the capture self-check against the model's own forward (warns)")
    p.add_argument("--sources-only", action="store_true",
                   help="GPU targets: ship kernel sources without cubin/hsaco/SPIR-V binaries (Triton JIT-compiles them "
                        "on the device; also PORTLAYER_SOURCES_ONLY=1)")
    p.set_defaults(func=run_compile)

    v = sub.add_parser("validate", help="re-run an artifact's validation set on this device",
                       description="Verify ARTIFACT, run its validation set here and report max error per output.")
    v.add_argument("artifact", help="artifact directory written by `portlayer compile`")
    v.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    v.add_argument("--emulate-ascend", action="store_true",
                   help="run a CANN (Ascend) artifact on the CPU emulator of the torch_npu calls, not an NPU "
                        "(also PORTLAYER_ASCEND_EMULATOR=1; see docs/ascend.md)")
    v.add_argument("--interpret", action="store_true",
                   help="run a Triton artifact (CUDA/ROCm/XPU target) on this CPU under the Triton interpreter "
                        "(CUDA graphs off), to check a cross-compiled artifact without its device")
    v.set_defaults(func=run_validate)

    b = sub.add_parser("bench", help="latency and throughput of an artifact on this device")
    b.add_argument("artifact", help="artifact directory written by `portlayer compile`")
    b.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    b.add_argument("--prefill-tokens", type=int, default=128)
    b.add_argument("--context", type=int, default=128, help="cached tokens per sequence for decode steps")
    b.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    b.add_argument("--iters", type=int, default=10)
    b.add_argument("--calibration", default=None, metavar="FILE",
                   help="predict with this calibrated descriptor's curves (default: the artifact's descriptor)")
    b.add_argument("--no-predict", action="store_true", help="skip the cost model's predicted column")
    b.set_defaults(func=run_bench)

    c = sub.add_parser("cache", help="list or clear the artifact cache")
    csub = c.add_subparsers(dest="cache_command", metavar="ACTION")
    csub.required = True
    cl = csub.add_parser("list", help="cached artifacts (model, target, size)")
    cl.add_argument("--json", action="store_true")
    cl.set_defaults(func=run_cache_list)
    cc = csub.add_parser("clear", help="remove cached artifacts")
    cc.add_argument("--all", action="store_true", help="also remove captured graphs and materialised example models")
    cc.set_defaults(func=run_cache_clear)


def _say(msg: str) -> None:
    print(f"[portlayer] {msg}", file=sys.stderr)


def run_compile(args: argparse.Namespace) -> int:
    import portlayer

    art = portlayer.compile(args.model, target=args.target, output=args.output, dtype=args.dtype,
                            quantize=args.quantize, progress=not args.no_progress, strict=args.strict,
                            verify=not args.no_verify, sources_only=args.sources_only or None,
                            tensor_parallel=args.tensor_parallel, calibration_device=args.calibration_device,
                            kv_cache_dtype=args.kv_cache_dtype)
    m = art.manifest
    if art.cache_hit:
        print(f"cache hit: {m.model.get('spec')} for {m.target.get('name')} is already compiled ({art.seconds:.2f} s)")
    else:
        print(f"compiled {m.model.get('spec')} for {m.target.get('name')} in {art.seconds:.1f} s")
    gen = m.raw.get("codegen", {})
    print(f"artifact: {art.path}")
    print(f"  {len(m.files)} files; generated sources: {len(gen.get('files', []))}; "
          f"passes: {m.raw.get('stages', {}).get('passes')}")
    split = _time_split(m.raw.get("timings_s") or {})
    if split:
        print(f"  time: {split}" + (" (when it was compiled)" if art.cache_hit else ""))
    _print_gate(m.raw.get("quality_gate"))
    print(f"next: portlayer validate {art.path}")
    return 0


def _time_split(timings: dict) -> str:
    """'capture 1.2 s, passes 0.4 s, codegen 0.3 s, ...' from the manifest's stage timings."""
    order = ["capture", "passes", "codegen"]
    names = order + [k for k in timings if k not in order]
    return ", ".join(f"{k} {float(timings[k]):.2f} s" for k in names
                     if isinstance(timings.get(k), (int, float)) and not isinstance(timings.get(k), bool))
def _print_gate(doc: dict | None) -> None:
    """The quality gate's figures recorded in the manifest (docs/quantization.md)."""
    if not isinstance(doc, dict):
        return
    for r in doc.get("rejected") or []:
        print(f"  quality gate rejected {r.get('mode')}: top-1 {r.get('top1', 0):.1%}, mean KL {r.get('mean_kl', 0):.4f}, "
              f"perplexity ratio {r.get('ppl_ratio', 0):.4f} ({'; '.join(r.get('failures') or [])})")
    c = doc.get("compiled")
    if isinstance(c, dict):
        verdict = "passed" if c.get("passed") else "BELOW THRESHOLD: " + "; ".join(c.get("failures") or [])
        print(f"  quality gate for {c.get('mode')}: top-1 {c.get('top1', 0):.1%}, mean KL {c.get('mean_kl', 0):.4f}, "
              f"perplexity ratio {c.get('ppl_ratio', 0):.4f} over {c.get('tokens')} tokens: {verdict}")
    if doc.get("warning"):
        print(f"  WARNING: {doc['warning']}")


def run_validate(args: argparse.Namespace) -> int:
    from portlayer.loaded import open_artifact, print_notes

    interpret = bool(getattr(args, "interpret", False))
    loaded = open_artifact(Path(args.artifact), emulate=True if getattr(args, "emulate_ascend", False) else None,
                           interpret=interpret)
    if loaded.interpreted:
        print("[portlayer] running the generated Triton program under the Triton interpreter on the CPU (not the "
              f"{loaded.descriptor.name})", file=sys.stderr)
    if loaded.emulated:
        print("[portlayer] running on the CPU emulator of the torch_npu calls (emulation, not an Ascend NPU)",
              file=sys.stderr)
    print_notes(loaded)
    t0 = time.perf_counter()
    report = loaded.validate()
    print(report.format_table())
    _print_gate(loaded.manifest.raw.get("quality_gate") if hasattr(loaded, "manifest") else None)
    print(f"({time.perf_counter() - t0:.2f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=1) + "\n")
    return 0 if report.ok else 1


def run_bench(args: argparse.Namespace) -> int:
    import portlayer
    from portlayer.bench import bench, format_report
    from portlayer.loaded import print_notes

    loaded = portlayer.load(args.artifact)
    print_notes(loaded)
    r = bench(loaded, prefill_tokens=args.prefill_tokens, context=args.context, batch_sizes=args.batch, iters=args.iters)
    print(format_report(r))
    if not getattr(args, "no_predict", False):
        from portlayer.cli_predict import bench_predictions

        text, r["predicted"] = bench_predictions(loaded, r, getattr(args, "calibration", None))
        print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
        _say(f"wrote {args.json}")
    return 0


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def run_cache_list(args: argparse.Namespace) -> int:
    from portlayer.runtime import cache

    entries = cache.list_entries()
    if args.json:
        print(json.dumps([{**e.__dict__, "path": str(e.path)} for e in entries], indent=1))
        return 0
    print(f"cache: {cache.cache_root()}")
    if not entries:
        print("  no cached artifacts")
    for e in entries:
        opts = ",".join(f"{k}={v}" for k, v in e.options.items() if v) or "defaults"
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.created_unix)) if e.created_unix else "?"
        print(f"  {e.path.name}  {e.model:<24} {e.target:<22} {opts:<18} {_size(e.bytes):>10}  {when}  {e.status}")
    print("  " + ", ".join(f"{what} {_size(n)}" for what, n in cache.iter_sizes()))
    return 0


def run_cache_clear(args: argparse.Namespace) -> int:
    from portlayer.runtime import cache

    n = cache.clear(everything=args.all)
    extra = " (and captured graphs, example models)" if args.all else ""
    print(f"removed {n} cached artifact(s){extra} from {cache.cache_root()}")
    return 0
