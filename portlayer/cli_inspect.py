"""``portlayer inspect MODEL``: the captured (or optimised) IR as text, JSON or DOT."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from portlayer.flatten.ir import Graph


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show a model's Flat IR (text, json or dot)", formatter_class=PassNamesFormatter,
                       description="Capture MODEL (a local HF directory or a built-in example name) and show its IR.")
    p.add_argument("model", help="local HF directory, or a built-in name such as tiny-qwen3 or all-minilm-l6-v2")
    p.add_argument("--format", choices=("text", "json", "dot"), default="text")
    p.add_argument("--target", default=None,
                   help="run the pass pipeline for this descriptor (name, 'auto' or path.json) before showing")
    p.add_argument("--after", default=None, help="with --target: show the graph after this pass (default: all passes); passes in order: {passes}")
    p.add_argument("--dump-passes", default=None, metavar="DIR", help="with --target: write the IR after every pass to DIR")
    p.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    p.set_defaults(func=run)


class PassNamesFormatter(argparse.HelpFormatter):
    """Fills ``{passes}`` in help texts with the pipeline's pass names, only when help is shown
    (importing the pipeline costs seconds that other invocations should not pay)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        if text and "{passes}" in text:
            text = text.replace("{passes}", ", ".join(_pass_names()))
        return text


def _pass_names() -> list[str]:
    from portlayer.passes.pipeline import pass_names

    return pass_names()


def summary(graph: Graph, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON summary of a graph (also used by notebooks and artifact manifests)."""
    from portlayer.flatten.ops import graph_cost

    per_token = graph_cost(graph, {"num_tokens": 1, "num_seqs": 1})
    params = {name: {"dtype": t.dtype, "shape": list(t.shape)} for name, t in graph.params.items()}
    out: dict[str, Any] = {
        "num_nodes": len(graph.nodes),
        "ops": graph.op_counts(),
        "params": params,
        "num_params": sum(t.numel() for t in graph.params.values()),
        "param_bytes": sum(t.nbytes() for t in graph.params.values()),
        "inputs": [{"name": v.name, "dtype": v.type.dtype, "shape": list(v.type.shape)} for v in graph.inputs],
        "outputs": [{"name": o, **graph.value_types()[o].to_json()} for o in graph.outputs],
        "flops_per_token": per_token.flops,
        "bytes_per_token": per_token.bytes,
        "meta": {k: v for k, v in graph.meta.items() if isinstance(v, (str, int, float, bool, list, type(None)))},
    }
    if extra:
        out.update(extra)
    return out


def run(args: argparse.Namespace) -> int:
    from portlayer.errors import UsageError
    from portlayer.flatten import capture

    if args.after is not None and args.after not in _pass_names():
        raise UsageError(f"--after {args.after!r} is not a pass; passes in order: {', '.join(_pass_names())}")
    if (args.after or args.dump_passes) and not args.target:
        raise UsageError("--after and --dump-passes need --target NAME (the descriptor whose passes to run)")

    graph = capture(args.model, progress=lambda m: print(f"[portlayer] {m}", file=sys.stderr))
    extra: dict[str, Any] = {}
    if args.target:
        from portlayer.passes.pipeline import inspect_report, run_pipeline

        result = run_pipeline(graph, args.target, stop_after=args.after, dump_dir=args.dump_passes)
        graph = result.graph
        extra = inspect_report(result)
    if args.format == "json":
        text = json.dumps(summary(graph, extra), indent=2)
    elif args.format == "dot":
        from portlayer.flatten.notebook import graph_dot

        text = graph_dot(graph)
    else:
        from portlayer.flatten.printer import print_graph

        text = print_graph(graph, show_meta=bool(args.target))
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0
