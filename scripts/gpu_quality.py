"""The quality gate's figures for SmolLM2 with bf16 compute on a CUDA device (docs/quantization.md).

Runs from a source checkout, no installs:

    PYTHONPATH=. python scripts/gpu_quality.py --gguf .devcarry/SmolLM2-135M-Instruct.Q4_1.gguf

The GGUF is read with the ``gguf`` package (pure Python); where it is not installed, copy its
folder (site-packages/gguf, 1.4 MB) to ``.devcarry/site/gguf`` and it is found there. Each
format is quantized as ``portlayer compile`` would (passes/quantize.py), then
the float and quantized graphs run on the reference interpreter on the GPU and are graded by
passes/quality_gate.py: once with the quantized model in bf16 against the float32 model (what
a bf16 deployment sees), and once with the float model itself in bf16 (the bf16 floor).
Prints a table and writes JSON (``--json``, else ``$OUT/gpu_quality_<device>_<dtype>.json`` when
$OUT is set) after every variant, so a run cut short keeps what it measured; no variant starts
after ``--budget`` seconds (default 390: the whole run stays within 7 minutes on an H200). The
calibration run, AWQ's search and GPTQ run on ``--device`` (``calibration_device``).
``--variants all`` grades every variant below.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: name -> (format, quantize-pass options); the first of each format is what `--quantize` compiles by default
VARIANTS: dict[str, tuple[str, dict]] = {
    "int8": ("int8", {}),  # group 32, asymmetric, round-to-nearest
    "int8-per-channel": ("int8", {"group_size": 1 << 30, "symmetric": True, "quant_method": "rtn"}),
    "int8-per-channel-gptq": ("int8", {"group_size": 1 << 30, "symmetric": True, "quant_method": "gptq"}),
    "int4": ("int4", {}),  # the default calibrated method (passes/quantize.py DEFAULT_METHOD)
    "int4-rtn": ("int4", {"quant_method": "rtn"}),
    "int4-clip": ("int4", {"quant_method": "clip"}),
    "int4-awq": ("int4", {"quant_method": "awq"}),
    "int4-gptq": ("int4", {"quant_method": "gptq"}),
    "int4-gptq-act": ("int4", {"quant_method": "gptq", "act_order": True}),
    "int4-awq-gptq-act": ("int4", {"quant_method": "awq+gptq", "act_order": True}),
    "int4-awq-float-calib": ("int4", {"quant_method": "awq", "sequential": False}),
    "int4-g32": ("int4", {"group_size": 32, "quant_method": "rtn"}),
}
#: the default set: fits the 7-minute budget on an H200 (calibration and GPTQ on the GPU)
QUICK = ("int8", "int4", "int4-rtn", "int4-gptq-act", "int4-awq-gptq-act", "int4-g32")  # int4 is int4-clip


def _paths() -> None:
    if str(ROOT) not in sys.path:  # a plain checkout: portlayer/ maps the stage folders (no install needed)
        sys.path.insert(0, str(ROOT))
    site = ROOT / ".devcarry" / "site"
    if site.is_dir():
        sys.path.insert(0, str(site))
    os.environ.setdefault("PORTLAYER_CACHE", str(ROOT / ".devcarry" / "cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="path to SmolLM2-135M-Instruct.Q4_1.gguf (or any llama-family GGUF)")
    src.add_argument("--model", help="instead: an HF directory or a built-in name (tiny-llama: a smoke test of this script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--formats", nargs="+", default=["native", "int8", "int4"])
    ap.add_argument("--target", default="nvidia-h200", help="descriptor whose plan (group size, ...) is used")
    ap.add_argument("--variants", nargs="+", default=list(QUICK), metavar="NAME",
                    help=f"int8/int4 variants to grade, or 'all' (default: {' '.join(QUICK)}; all: {' '.join(VARIANTS)})")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--calibration-tokens", type=int, default=None, help="cap on the calibration text (default: the pass's)")
    ap.add_argument("--budget", type=float, default=390.0, metavar="SECONDS",
                    help="start no new variant after this many seconds (the H200 slot is 10 minutes; default 390)")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants if v != "all" and v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    _paths()

    import torch

    from portlayer.build import capture_cached
    from portlayer.builtin_models import resolve_model
    from portlayer.passes.calibration import GATE_TEXT, token_ids
    from portlayer.passes.pipeline import run_pipeline
    from portlayer.passes.quality_gate import evaluate
    from portlayer.runtime.cache import model_dir_hash
    from portlayer.runtime.validation import build_cases

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_quality: no CUDA device here; pass --device cpu to run the same figures on the CPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model_dir = resolve_model(args.gguf or args.model)
    graph = capture_cached(model_dir, model_dir_hash(model_dir), lambda _m: None)  # reused by a later run
    ids, how = token_ids(graph, GATE_TEXT, args.max_tokens)
    prompts = [c.steps[0].input_ids for c in build_cases(graph) if not c.paged]
    print(f"captured {graph.meta.get('model_type')} ({len(graph.nodes)} nodes) in {time.perf_counter() - t0:.0f} s; text: {how}")
    rows = []
    base = evaluate(graph, graph, "none", ids, how, prompts, args.device, dtype)
    rows.append({"format": f"none ({args.dtype})", **base.to_json()})
    native = bool(graph.meta.get("source")) and (Path(graph.meta["source"]) / "gguf_native.json").is_file()
    todo = [("native", "native", None)] if native and "native" in args.formats else []
    todo += [(name, fmt, opts) for name, (fmt, opts) in VARIANTS.items()
             if fmt in args.formats and ("all" in args.variants or name in args.variants)]
    if args.json is None and os.environ.get("OUT"):
        args.json = str(Path(os.environ["OUT"]) / f"gpu_quality_{args.device.split(':')[0]}_{args.dtype}.json")
    _write(args, rows)
    for name, fmt, opts in todo:
        if time.perf_counter() - t0 > args.budget:
            print(f"budget of {args.budget:.0f} s spent: {name} and later variants not run", flush=True)
            rows.append({"format": name, "skipped": f"budget of {args.budget:.0f} s spent"})
            continue
        opts = dict(opts or {}, calibration_device=args.device)
        if args.calibration_tokens:
            opts["calibration_tokens"] = args.calibration_tokens
        t1 = time.perf_counter()
        res = run_pipeline(graph, args.target, overrides={"weight_quantization": fmt}, verify=False, options=opts)
        tq = time.perf_counter() - t1
        r = evaluate(graph, res.graph, fmt, ids, how, prompts, args.device, dtype)
        rows.append({"format": f"{name} ({args.dtype})", "method": res.graph.meta.get("quantization", {}).get("method"),
                     **r.to_json(), "quantize_seconds": round(tq, 1), "seconds": round(time.perf_counter() - t1, 1)})
        print(rows[-1]["format"], f"{rows[-1]['method']}: {r.summary()} [quantize {tq:.0f} s, total {rows[-1]['seconds']} s]",
              flush=True)
        _write(args, rows)  # after each variant: a run cut short keeps what it measured
    print(f"{'format':<36} {'top-1':>7} {'mean KL':>9} {'ppl ratio':>10} {'quantize s':>10}  gate")
    for r in rows:
        if "skipped" in r:
            print(f"{r['format']:<36} {'':>7} {'':>9} {'':>10} {'':>10}  skipped: {r['skipped']}")
            continue
        verdict = "pass" if r["passed"] else "FAIL: " + "; ".join(r["failures"])
        print(f"{r['format']:<36} {r['top1']:>7.1%} {r['mean_kl']:>9.4f} {r['ppl_ratio']:>10.4f} "
              f"{r.get('quantize_seconds', 0):>10}  {verdict}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


def _write(args: argparse.Namespace, rows: list[dict]) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps({"device": args.device, "dtype": args.dtype, "rows": rows}, indent=1) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    sys.exit(main())
