"""`portlayer explain --predict` and the predicted column of `portlayer bench` (passes/cost_model.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from portlayer.errors import UsageError


def calibration_raw(path: str | None, fallback: dict[str, Any]) -> dict[str, Any]:
    """The descriptor whose curves the prediction uses: a calibrated file when given, else the plan's target.

    With a file, its measured curves and peaks, with ``fallback``'s codegen and GEMM thresholds (the
    compiled program follows those, whatever the calibration measured)."""
    if not path:
        return fallback
    from portlayer.capabilities.descriptor import load_descriptor

    try:
        raw = dict(load_descriptor(Path(path)).raw)
    except (OSError, ValueError) as e:
        raise UsageError(f"--calibration {path}: {str(e)[:300]}; pass a file written by `portlayer calibrate -o`") from None
    # the program's code paths (GEMM thresholds, codegen family) are the compiled target's; only the curves are new
    raw["codegen"] = fallback["codegen"]
    raw["tuning"] = dict(fallback.get("tuning") or {})
    return raw


def explain_predict(model: str, target: Any, overrides: dict[str, Any], calibration: str | None,
                    batches: list[int], context: int, prefill_tokens: int) -> str:
    """Capture, run the pass pipeline for ``target`` (as compile does) and predict the standard steps."""
    from portlayer.flatten.capture import capture as capture_graph
    from portlayer.flatten.logits import select_logit_rows
    from portlayer.passes.cost_model import format_predictions, predict_steps
    from portlayer.passes.pipeline import run_pipeline

    result = run_pipeline(select_logit_rows(capture_graph(model)), target, overrides=overrides or None)
    raw = calibration_raw(calibration, dict(result.descriptor.raw))
    preds = predict_steps(result.graph, result.plan, raw, batches, context, prefill_tokens)
    curves = "calibrated curves" if raw.get("calibration") else "descriptor peaks (run `portlayer calibrate` for curves)"
    return f"{format_predictions(preds)}\n  device model: {raw['name']}, {curves}"


def bench_predictions(loaded: Any, report: dict[str, Any], calibration: str | None) -> tuple[str, list[dict[str, Any]]]:
    """Predicted beside measured for every step ``bench`` timed; lines and JSON rows."""
    from portlayer.bench import measured_ms
    from portlayer.passes.cost_model import predict

    raw = calibration_raw(calibration, dict(loaded.descriptor.raw))
    rows = []
    p = report["prefill"]
    pred = predict(loaded.graph, loaded.plan, raw, "prefill", tokens=p["tokens"])
    rows.append({"step": f"prefill {p['tokens']} tok", "measured_ms": measured_ms(p), "predicted_ms": pred.ms})
    for d in report["decode"]:
        pred = predict(loaded.graph, loaded.plan, raw, "decode", d["batch"], d["context"])
        rows.append({"step": f"decode batch {d['batch']}", "measured_ms": measured_ms(d), "predicted_ms": pred.ms})
    for r in rows:
        r["error_pct"] = 100.0 * (r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"]
    curves = "calibrated curves" if raw.get("calibration") else "descriptor peaks"
    clock = "process CPU time" if "cpu_ms" in p else "wall time"
    lines = [f"predicted vs measured ({raw['name']}, {curves}; measured: {clock}):"]
    cal = raw.get("calibration") or {}
    if cal.get("threads") and report.get("threads") and int(cal["threads"]) != int(report["threads"]):
        lines.append(f"  note: calibrated with {cal['threads']} torch threads, benchmarked with {report['threads']}; "
                     "set OMP_NUM_THREADS the same for both")
    lines += [f"  {r['step']:<18} measured {r['measured_ms']:9.3f} ms   predicted {r['predicted_ms']:9.3f} ms   "
              f"{r['error_pct']:+6.1f}%" for r in rows]
    return "\n".join(lines), rows


__all__ = ["bench_predictions", "calibration_raw", "explain_predict"]
