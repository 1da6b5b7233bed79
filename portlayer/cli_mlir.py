"""``portlayer export-mlir MODEL -o model.mlir``: the Flat IR as MLIR (torch-mlir's FX importer).

The exported function is ``forward(input_ids: tensor<?xi64>, positions: tensor<?xi64>)``, one
sequence, no KV cache, returning what the graph returns (logits, hidden states or a pooled
embedding). ``--check`` compiles it with IREE for llvm-cpu, runs it at 1, 9 and 40 tokens and
compares with the reference interpreter (max abs error <= 1e-4).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export-mlir", help="export a model's Flat IR as MLIR (torch or linalg dialect)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="local HF directory, .onnx file, or a built-in name such as tiny-qwen3")
    p.add_argument("-o", "--output", required=True, help="the .mlir file to write")
    p.add_argument("--dialect", choices=("torch", "linalg"), default="torch",
                   help="torch: the torch dialect as imported; linalg: lowered to linalg-on-tensors")
    p.add_argument("--after", default=None, help="run the pass pipeline up to this pass first (needs --target)")
    p.add_argument("--target", default="auto", help="descriptor for --after (name, 'auto' or path.json)")
    p.add_argument("--static", action="store_true", help="fix the token count at export (7) instead of dynamic")
    p.add_argument("--check", action="store_true",
                   help="compile with IREE llvm-cpu, run at 1/9/40 tokens, compare with the reference interpreter")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from portlayer.flatten.capture import capture
    from portlayer.flatten.to_mlir import export_mlir, iree_check, parse_check

    def say(msg: str) -> None:
        print(f"[portlayer] {msg}", file=sys.stderr)

    graph = capture(args.model, progress=say)
    if args.after:
        from portlayer.errors import UsageError
        from portlayer.passes.pipeline import run_pipeline

        try:
            graph = run_pipeline(graph, args.target, stop_after=args.after).graph
        except ValueError as e:
            raise UsageError(str(e)) from None
    say(f"exporting ({args.dialect} dialect)")
    text = export_mlir(graph, args.dialect, dynamic=not args.static)
    parse_check(text)
    out = Path(args.output)
    out.write_text(text)
    print(f"wrote {out} ({len(text) / 1e6:.1f} MB, {args.dialect} dialect): "
          "forward(input_ids: tensor<?xi64>, positions: tensor<?xi64>)")
    if args.check:
        say("compiling with IREE for llvm-cpu")
        max_pos = int(graph.meta.get("max_positions") or 4096)
        for r in iree_check(graph, text, args.dialect, lengths=tuple(n for n in (1, 9, 40) if n <= max_pos)):
            print(f"check: {r}")
        print("check: PASSED")
    return 0
