"""On the GPU: overlapped steps give the same greedy tokens as the synchronous engine, with EOS
stops and without, on a compiled artifact (runtime/overlap.py); prints the timing of both.

    python scripts/gpu_overlap_check.py ARTIFACT [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from _bootstrap import bootstrap  # noqa: E402

bootstrap()

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.sequence import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 30000, (int(n),), generator=g).tolist() for n in torch.randint(4, 300, (24,), generator=g)]
    out: dict = {}
    runs = {}
    for mode in ("sync", "overlap"):
        eng = LLMEngine.from_artifact(args.artifact, overlap=(mode == "overlap"), enable_prefix_caching=False)
        for case, params, eos in (("ignore_eos", SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True), None),
                                  ("eos", SamplingParams(temperature=0.0, max_tokens=96), "pick")):
            if eos == "pick":  # the model's EOS becomes a token the sync run emits mid-way for some prompt
                eng.eos_token_id = runs[("sync", "ignore_eos")][0][20]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            toks = [o.token_ids for o in eng.generate(prompts, params)]
            torch.cuda.synchronize()
            runs[(mode, case)] = toks
            out[f"{mode}_{case}_s"] = round(time.perf_counter() - t0, 3)
        out[f"{mode}_overlapped_steps"] = eng.stats["overlapped_steps"]
        del eng
        torch.cuda.empty_cache()
    for case in ("ignore_eos", "eos"):
        a, b = runs[("sync", case)], runs[("overlap", case)]
        out[f"equal_{case}"] = a == b
        out[f"differ_{case}"] = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    out["eos_stopped"] = sum(len(t) < 96 for t in runs[("sync", "eos")])
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    ok = out["equal_ignore_eos"] and out["equal_eos"] and out["overlap_overlapped_steps"] > 0
    print("GPU_OVERLAP:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
