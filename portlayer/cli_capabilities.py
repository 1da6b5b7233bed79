"""`portlayer devices`, `portlayer calibrate` and `portlayer explain`.

``add_parsers(subparsers)`` registers them on the main CLI; each sets ``func`` to a
function taking the parsed args and returning an exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_parsers(subparsers: Any) -> None:
    p = subparsers.add_parser("devices", help="devices on this machine, their descriptors and why others are missing")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_devices)

    p = subparsers.add_parser("calibrate", help="measure this device and write a calibrated descriptor")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the best device here)")
    p.add_argument("--base", default=None, help="shipped descriptor to start from (default: the one probe matched)")
    p.add_argument("-o", "--output", default=None, help="write the descriptor JSON here (default: stdout)")
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer points (about a minute)")
    p.set_defaults(func=cmd_calibrate)

    p = subparsers.add_parser("explain", help="the Plan (dtype, KV blocks, launch configs, ...) with reasons")
    p.add_argument("model", help="HF model dir or config.json, a saved Flat IR dir (graph.json), or a builtin name")
    p.add_argument("--target", default=None, help="descriptor name or path.json (default: best device here)")
    p.add_argument("--dtype", default=None, help="force the compute dtype (float32, bfloat16, float16)")
    p.add_argument("--quantization", default=None, help="force weight quantization (none, int8, int4)")
    p.add_argument("--capture", action="store_true", help="capture the model graph instead of reading config.json")
    p.add_argument("--tensor-parallel", default=None, metavar="N|auto",
                   help="plan for N ranks, or the smallest N that fits (docs/parallel.md)")
    p.add_argument("--json", action="store_true", help="print the Plan as JSON")
    p.add_argument("--gate", action="store_true",
                   help="capture, quantize and run the quality gate on a lossy pick, as compile does (docs/quantization.md)")
    p.add_argument("--predict", action="store_true",
                   help="capture, run the passes and print the cost model's ms/step and tok/s (docs/capabilities.md)")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="with --predict: use this calibrated descriptor's curves instead of the target's numbers")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64], help="with --predict: decode batch sizes")
    p.add_argument("--context", type=int, default=128, help="with --predict: cached tokens per decoding sequence")
    p.add_argument("--prefill-tokens", type=int, default=128, help="with --predict: tokens of the prefill step")
    p.add_argument("--host-memory", default=None, metavar="GIB", type=float,
                   help="check the memory needs against this much host memory (default: this machine's)")
    p.set_defaults(func=cmd_explain)


def cmd_devices(args: argparse.Namespace) -> int:
    from portlayer.capabilities.probe import default_target, probe_devices, summary_lines

    devices = probe_devices()
    target = default_target(devices)
    if args.json:
        print(json.dumps({"devices": [d.to_json() for d in devices], "default_target": target.name}, indent=2))
        return 0
    print("portlayer devices:")
    print("\n".join(summary_lines(devices)))
    accel = [d for d in devices if d.usable and d.device_type != "cpu"]
    if not accel:
        print("No accelerator found (reasons above); falling back to the CPU.")
    print(f"default target: {target.name} ({target.origin})")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from portlayer.capabilities.calibrate import run_cli

    desc = run_cli(args.device, base=args.base, quick=getattr(args, "quick", False), extra=_calibration_extras())
    text = json.dumps(desc, indent=2) + "\n"
    if args.output:
        Path(args.output).write_text(text)
        tp = ", ".join(f"{k} {v:g}" for k, v in desc["throughput_tflops"].items())
        print(
            f"wrote {args.output}: copy {desc['memory']['bandwidth_gbps']:g} GB/s; matmul TFLOP/s: {tp}; "
            f"launch {desc['launch_overhead_us']:g} us. Use it with --target {args.output}",
            file=sys.stderr,
        )
    else:
        sys.stdout.write(text)
    return 0


def _calibration_extras() -> list:
    """Benchmarks that need a generated kernel live in backends/ (capabilities cannot import it)."""
    from portlayer.backends.calibration_runner import extras
    from portlayer.passes.pipeline import run_pipeline

    return extras(run_pipeline)


#: config.json keys the analytic (no-capture) requirements need; other configs are captured instead
ANALYTIC_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")


def load_requirements(model: str, capture: bool = False):
    """ModelRequirements from a saved graph dir, an HF dir/config.json, or a captured graph.

    config.json is read analytically only when it has the Llama/Qwen-style keys; any other
    architecture (GPT-2's n_embd, ...) is captured, which works for every supported model."""
    from portlayer.capabilities.requirements import ModelRequirements
    from portlayer.errors import UsageError

    path = Path(model)
    if path.suffix.lower() == ".onnx":  # an ONNX file: its imported graph
        from portlayer.flatten.onnx_import import import_onnx

        return ModelRequirements.from_graph(import_onnx(path), name=model)
    from portlayer.flatten.gguf_source import find_gguf

    if path.exists() and find_gguf(path) is not None:  # a .gguf: its converted HF directory
        from portlayer.builtin_models import resolve_model

        path = Path(resolve_model(model))
    if (path / "graph.json").exists():
        from portlayer.flatten.serialize import load_graph

        return ModelRequirements.from_graph(load_graph(path), name=model)
    if not path.exists():
        from portlayer.builtin_models import resolve_model

        path = Path(resolve_model(model))
    config = path if path.suffix == ".json" else path / "config.json"
    if path.is_file() and path.suffix != ".json":
        raise UsageError(f"{path}: expected an HF model directory, its config.json, or a saved graph directory")
    raw = None
    if config.is_file():
        try:
            raw = json.loads(config.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise UsageError(f"{config}: not valid JSON ({str(e)[:200]}); fix the file or re-save the model") from None
    analytic = isinstance(raw, dict) and all(isinstance(raw.get(k), int) for k in ANALYTIC_KEYS)
    if capture or not analytic:
        if path.suffix == ".json":
            path = path.parent
        from portlayer.flatten.capture import capture as capture_graph

        return ModelRequirements.from_graph(capture_graph(str(path)), name=model)
    return ModelRequirements.from_hf_config(raw, name=model)


def cmd_explain(args: argparse.Namespace) -> int:
    from portlayer.capabilities.descriptor import load_descriptor
    from portlayer.capabilities.policy import negotiate
    from portlayer.capabilities.probe import default_target

    req = load_requirements(args.model, capture=args.capture)
    target = load_descriptor(args.target) if args.target else default_target()
    overrides = {}
    if args.dtype:
        overrides["compute_dtype"] = args.dtype
    if args.quantization:
        overrides["weight_quantization"] = args.quantization
    if getattr(args, "tensor_parallel", None):
        overrides["tensor_parallel"] = args.tensor_parallel if args.tensor_parallel == "auto" else _degree(args.tensor_parallel)
    # a PlanError is a user error: the CLI prints it, exit 2
    if args.gate:
        plan = _gated_plan(args.model, target, overrides)
    else:
        plan = negotiate(req, target, overrides, quality=_quality(args.model))
    needs = _memory_needs(args.model, req, plan, target)
    if args.json:
        print(plan.dumps())
    else:
        print(plan.format_table())
        print(needs.format_table())
    _check_host_memory(needs, target, getattr(args, "host_memory", None))
    if getattr(args, "predict", False):
        from portlayer.cli_predict import explain_predict

        text = explain_predict(args.model, target, overrides, args.calibration, args.batch, args.context,
                               args.prefill_tokens)
        print(text, file=sys.stderr if args.json else sys.stdout)  # --json keeps stdout one JSON document
    return 0


def _degree(text: str) -> int:
    from portlayer.capabilities.plan import PlanError

    try:
        return int(text)
    except ValueError:
        raise PlanError(f"--tensor-parallel {text!r}: use a positive number of ranks, or auto") from None


def _memory_needs(model: str, req, plan, target):
    """Host and device memory of compiling and serving (capabilities/memory_needs.py), from the files' sizes."""
    from portlayer.capabilities.memory_needs import checkpoint_bytes, memory_needs

    path = Path(model)
    if not path.exists():
        try:
            from portlayer.builtin_models import resolve_model

            path = Path(resolve_model(model))
        except (FileNotFoundError, ValueError, RuntimeError, OSError):
            path = None
    if path is not None and path.suffix == ".json":
        path = path.parent
    stored, _ = checkpoint_bytes(path, req)
    return memory_needs(req, plan, target.device_type, stored)


def _check_host_memory(needs, target, host_gib: float | None) -> None:
    """A PlanError (the CLI prints it, exit 2) when this machine cannot compile (or, CPU, serve) the model."""
    from portlayer.capabilities.memory_needs import check_host, host_memory_bytes

    if host_gib is not None:
        available, where = int(host_gib * (1 << 30)), "--host-memory"
    else:
        available, where = host_memory_bytes()
    check_host(needs, available, where, serving_here=target.device_type == "cpu")


def _quality(model: str) -> dict | None:
    """Native GGUF blocks of the model source, which the policy keeps by default."""
    from portlayer.flatten.gguf_source import native_summary

    try:
        from portlayer.builtin_models import resolve_model

        native = native_summary(resolve_model(model))
    except (FileNotFoundError, ValueError, RuntimeError):
        native = None
    return {"native": native} if native else None


def _gated_plan(model: str, target, overrides: dict):
    """The plan compile would use: the quality gate measured on the lossy pick, fallbacks with reasons."""
    from portlayer.flatten.capture import capture as capture_graph
    from portlayer.flatten.logits import select_logit_rows
    from portlayer.passes.gated import run_gated

    outcome = run_gated(select_logit_rows(capture_graph(model)), target, overrides)
    for line in outcome.lines():
        print(line)
    if outcome.warning:
        print(f"WARNING: {outcome.warning}")
    return outcome.result.plan


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m portlayer.cli_capabilities devices`) until cli.py wires these in."""
    parser = argparse.ArgumentParser(prog="portlayer")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
