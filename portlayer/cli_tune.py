"""`portlayer tune ARTIFACT`: autotune the artifact's launch configs on this device (backends/tuning_runner.py).

The result goes to this device's tuning file (capabilities/tuning.py); the next `portlayer compile`
for the same descriptor and toolchain plans with it, and its plan says which entry each family used.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parsers(subparsers: Any) -> None:
    p = subparsers.add_parser("tune", help="autotune launch configs per kernel family on this device")
    p.add_argument("artifact", help="artifact directory written by `portlayer compile` for this device")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64],
                   help="decode batches of the timed steps (each timed, their times summed; default 1 16 64)")
    p.add_argument("--context", type=int, default=128, help="cached tokens per decoding sequence")
    p.add_argument("--prefill-tokens", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--families", nargs="+", default=None, help="only these families (gemm, attention_decode, ...)")
    p.add_argument("--candidates", type=int, default=6, help="configs tried per family, the default included")
    p.add_argument("-o", "--output", default=None, help="write here instead of this device's tuning file")
    p.add_argument("--interpret", action="store_true",
                   help="run the candidates under the Triton interpreter on this CPU (TRITON_INTERPRET=1; a smoke test "
                        "of the search, its times are not the GPU's)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no family past this many seconds (the file is written after every family)")
    p.set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    import time

    import portlayer
    from portlayer.backends.tuning_runner import tune
    from portlayer.capabilities.tuning import default_path, find_tuning
    from portlayer.errors import UsageError

    if getattr(args, "interpret", False):
        from portlayer.runtime.loaded import open_artifact

        loaded = open_artifact(args.artifact, interpret=True)
    else:
        loaded = portlayer.load(args.artifact)
    desc = loaded.descriptor
    if desc.codegen != "triton":
        raise UsageError(f"{args.artifact}: codegen {desc.codegen!r} has no launch configs to tune (Triton targets only)")
    existing, _ = find_tuning(desc.name, desc.sha256)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    target = args.output or default_path(desc.name, desc.sha256)
    result = tune(loaded.graph, loaded.plan, desc, loaded.torch_device, batch=args.batch, context=args.context,
                  prefill=args.prefill_tokens, iters=args.iters, families=args.families, limit=args.candidates,
                  say=say, existing=existing, budget_s=getattr(args, "budget_s", None),
                  on_family=lambda f: f.save(target))
    path = result.save(target)
    print(f"wrote {path} ({len(result.entries)} entries, {time.perf_counter() - t0:.1f} s); the next compile for "
          f"{desc.name} uses it (`portlayer explain --target {desc.name}` shows the tuned launch.* decisions)")
    return 0
