"""Issue 19 in one command (scripts/gpu_calibrate.sh runs this): calibrate, predict beside bench, autotune.

Every step runs as its own process under a timeout cut from one deadline (DEADLINE_S, default 530 s),
and its record goes to $OUT/steps.json as soon as it ends, so a step that fails or runs out of time
costs its own results only. Steps, in order:

  calibrate1, calibrate2   `portlayer calibrate --quick` twice: wall time, progress lines, the spread (spread.json)
  compile_06b, compile_tiny   the Qwen3-0.6B shape (random weights, benchmarks/bench_serving.py) and tiny-qwen3,
                          compiled for the calibrated descriptor (cal1.json; the shipped one if that fails)
  bench_06b, bench_tiny   `portlayer bench --batch 1 16 64 --prefill-tokens 128`: measured beside predicted
  tune                    `portlayer tune` of the 0.6B artifact in the time left (a reserve kept for the two below)
  compile_tuned           the 0.6B shape again with the tuning file: its plan names the tuned entries; no tuning time
  bench_tuned             bench of the tuned artifact; per step against bench_06b, per family from the tuning file

TUNE=0 stops after bench_tiny (calibration and prediction only).
DEVICE=cpu runs the same plumbing on a CPU (TARGET cpu-x86_64, a 2-layer 0.6B shape, the tune steps on a
1-layer float32 nvidia-h200 artifact under the Triton interpreter with 2 candidates of one family).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = os.environ.get("PYTHON", sys.executable)
DEVICE = os.environ.get("DEVICE", "cuda")
SMOKE = DEVICE == "cpu"
TARGET = os.environ.get("TARGET", "cpu-x86_64" if SMOKE else "nvidia-h200")
LAYERS = int(os.environ.get("LAYERS", "2" if SMOKE else "28"))
VOCAB = int(os.environ.get("VOCAB", "4096" if SMOKE else "151936"))
OUT = Path(os.environ.get("OUT") or ROOT / "gpu-results" / "calibrate")
ARTS = Path(os.environ.get("ARTS") or ROOT / "out" / "calibrate-art")
DEADLINE = time.monotonic() + float(os.environ.get("DEADLINE_S", "530"))
BATCHES = ["1", "16", "64"]
RECORDS: list[dict[str, Any]] = []

COMPILE_06B = """
import sys, time
sys.path.insert(0, "benchmarks")
from bench_serving import build_model
import portlayer
layers, vocab, target, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
t0 = time.perf_counter()
portlayer.compile(build_model(layers, vocab, 0), target=target, output=out, progress=False)
print(f"compiled the Qwen3-0.6B shape ({layers} layers, vocab {vocab}) for {target} in {time.perf_counter() - t0:.1f} s")
"""

BENCH_INTERPRETED = """
import json, sys
from portlayer.bench import bench, format_report
from portlayer.cli_predict import bench_predictions
from portlayer.runtime.loaded import open_artifact
loaded = open_artifact(sys.argv[1], interpret=True)
r = bench(loaded, prefill_tokens=8, context=8, batch_sizes=(1,), warmup=0, iters=1, rounds=1)
print(format_report(r))
text, r["predicted"] = bench_predictions(loaded, r, None)
print(text)
open(sys.argv[2], "w").write(json.dumps(r, indent=1))
"""


def left() -> float:
    return DEADLINE - time.monotonic()


def save() -> None:
    (OUT / "steps.json").write_text(json.dumps(RECORDS, indent=1) + "\n")


def step(name: str, cmd: list[str], limit: float, env: dict[str, str] | None = None, reserve: float = 0.0,
         keep: int = 40) -> dict[str, Any]:
    """Run ``cmd`` under min(limit, time left - reserve); record rc, wall time and the output's tail."""
    budget = min(limit, left() - reserve)
    rec: dict[str, Any] = {"step": name, "cmd": " ".join(shlex.quote(c) for c in cmd)}
    if budget < 5:
        rec.update(rc=None, skipped=f"no time left ({left():.0f} s to the deadline, {reserve:.0f} s reserved)")
        print(f"== {name}: skipped, {rec['skipped']}", flush=True)
    else:
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                               timeout=budget)
            rc, text = p.returncode, (p.stdout or "") + (p.stderr or "")
        except subprocess.TimeoutExpired as e:
            rc = "timeout"
            text = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        rec.update(rc=rc, wall_s=round(time.monotonic() - t0, 1), limit_s=round(budget), tail=text.splitlines()[-keep:])
        print(f"== {name}: rc={rc}, {rec['wall_s']} s (limit {budget:.0f} s)", flush=True)
        for line in rec["tail"]:
            print(f"   {line[:260]}", flush=True)
    RECORDS.append(rec)
    save()
    return rec


def portlayer(*args: str) -> list[str]:
    return [PY, "-m", "portlayer.cli", *args]


def spread(a: Path, b: Path) -> dict[str, Any]:
    """Every number the two calibrations measured: both values and |a-b| / mean in %."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from calibrate_spread import spread_table

    table = spread_table(json.loads(a.read_text()), json.loads(b.read_text()))
    (OUT / "spread.json").write_text(json.dumps(table, indent=1) + "\n")
    rows = sorted(table["rows"], key=lambda r: -r["spread_pct"])
    print(f"== spread of calibrate --quick run 1 vs 2: worst {rows[0]['spread_pct'] if rows else 0:.1f}%, "
          f"{sum(r['spread_pct'] <= 10 for r in rows)}/{len(rows)} numbers within 10%")
    for r in rows:
        print(f"   {r['name']:<40} {r['a']:>11.4g} {r['b']:>11.4g} {r['spread_pct']:6.1f}%")
    return table


def compile_06b(out: Path, target: str, name: str, env: dict[str, str] | None = None, limit: float = 240,
                reserve: float = 0.0) -> dict[str, Any]:
    return step(name, [PY, "-c", COMPILE_06B, str(LAYERS), str(VOCAB), target, str(out)], limit, env, reserve)


def bench(art: Path, name: str, limit: float, reserve: float = 0.0) -> dict[str, Any]:
    js = OUT / f"{name}.json"
    rec = step(name, portlayer("bench", str(art), "--batch", *BATCHES, "--context", "128", "--prefill-tokens", "128",
                               "--json", str(js)), limit, reserve=reserve)
    if js.exists():
        rec["result"] = json.loads(js.read_text())
        save()
    return rec


def tuned_decisions(art: Path) -> list[dict[str, Any]]:
    plan = json.loads((art / "plan.json").read_text())
    return [{"name": d["name"], "value": d["value"], "reason": d["reason"]} for d in plan["decisions"]
            if d["name"].startswith("launch.")]


def per_family(tuning: Path) -> list[dict[str, Any]]:
    """The tuning file's entries: default vs tuned step time per family (the search timed both)."""
    if not tuning.exists():
        return []
    rows = []
    for key, e in sorted(json.loads(tuning.read_text())["entries"].items()):
        rows.append({"entry": key, "default_us": e["default_us"], "tuned_us": e["time_us"],
                     "change_pct": 100.0 * (e["time_us"] - e["default_us"]) / e["default_us"],
                     "config": e["config"], "default_config": e["default_config"], "candidates": e["candidates"]})
        print(f"   {key:<50} default {e['default_us']:9.1f} us  tuned {e['time_us']:9.1f} us  "
              f"{rows[-1]['change_pct']:+6.1f}%  {e['config']}")
    return rows


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    ARTS.mkdir(parents=True, exist_ok=True)
    cal1, cal2 = OUT / "cal1.json", OUT / "cal2.json"
    for i, cal, reserve in ((1, cal1, 360), (2, cal2, 330)):  # the reserve: what the compiles, benches and tune need
        step(f"calibrate{i}", portlayer("calibrate", "--device", DEVICE, "--quick", "-o", str(cal)), 130, keep=80,
             reserve=reserve * float(os.environ.get("DEADLINE_S", "530")) / 530)
    if cal1.exists() and cal2.exists():
        RECORDS.append({"step": "spread", **spread(cal1, cal2)})
        save()
    target = str(cal1) if cal1.exists() else TARGET
    a06, tiny = ARTS / "qwen3-0.6b", ARTS / "tiny"
    rec = compile_06b(a06, target, "compile_06b", reserve=60)
    if rec.get("rc") != 0 and target != TARGET:  # the calibrated descriptor refused: the shipped one, predicted with the file
        target = TARGET
        rec = compile_06b(a06, target, "compile_06b_shipped", reserve=60)
    bench(a06, "bench_06b", 200, reserve=40)
    step("compile_tiny", portlayer("compile", "tiny-qwen3", "--target", target, "-o", str(tiny)), 150, reserve=30)
    bench(tiny, "bench_tiny", 120, reserve=20)
    if os.environ.get("TUNE", "1") == "0":  # calibration and prediction only (the tuning steps were run before)
        print(f"== done (TUNE=0), {float(os.environ.get('DEADLINE_S', '530')) - left():.0f} s; records in {OUT / 'steps.json'}")
        return 0
    # autotuning: on the CPU a 1-layer float32 H200 artifact under the Triton interpreter (the search's plumbing)
    tuning = OUT / "tuning.json"
    tuning.unlink(missing_ok=True)
    env = {"PORTLAYER_TUNING": str(tuning)}
    if SMOKE:
        a06 = ARTS / "tune-h200"
        step("compile_tune_default", portlayer("compile", "tiny-qwen3", "--target", "nvidia-h200", "--dtype",
                                               "float32", "-o", str(a06)), 150)
        tune_args = ["--interpret", "--families", "gemm", "--candidates", "2", "--iters", "1", "--batch", "2",
                     "--prefill-tokens", "8"]
        env["TRITON_INTERPRET"] = "1"
    else:
        # the families a decode step spends most in first: the budget may end the search early
        fams = os.environ.get("FAMILIES", "gemv attention_decode gemm reduction attention_prefill pointwise rope").split()
        tune_args = ["--batch", "1", "16", "64", "--context", "512", "--iters", "5", "--candidates", os.environ.get("CANDIDATES", "6"), "--families", *fams]
    compile_s = next((r.get("wall_s", 120) for r in RECORDS if r["step"].startswith("compile_06b") and r.get("rc") == 0), 120)
    bench_s = next((r.get("wall_s", 60) for r in RECORDS if r["step"] == "bench_06b"), 60)
    reserve = compile_s + bench_s + 20  # the tuned compile and its bench must still fit
    budget = max(0.0, left() - reserve - 30)
    rec = step("tune", portlayer("tune", str(a06), "-o", str(tuning), "--budget-s", f"{budget:.0f}", *tune_args),
               budget + 60, env, reserve=reserve)
    rec["per_family"] = per_family(tuning)
    save()
    if tuning.exists():
        tuned = ARTS / "tuned"
        if SMOKE:
            step("compile_tuned", portlayer("compile", "tiny-qwen3", "--target", "nvidia-h200", "--dtype", "float32",
                                            "-o", str(tuned)), 150, env)
        else:
            compile_06b(tuned, target, "compile_tuned", env, limit=compile_s + 60)
        if (tuned / "plan.json").exists():
            RECORDS[-1]["launch_decisions"] = tuned_decisions(tuned)
            used = [d for d in RECORDS[-1]["launch_decisions"] if str(d["reason"]).startswith("tuned:")]
            print(f"== compile_tuned: {len(used)} launch decisions from tuned entries (no tuning during the compile)")
            for d in RECORDS[-1]["launch_decisions"]:
                print(f"   {d['name']:<26} {json.dumps(d['value'])}  <- {d['reason'][:150]}")
            save()
            if SMOKE:
                for art, name in ((a06, "bench_tune_default"), (tuned, "bench_tuned")):
                    step(name, [PY, "-c", BENCH_INTERPRETED, str(art), str(OUT / f"{name}.json")], 120,
                         {"TRITON_INTERPRET": "1"})
            else:
                bench(tuned, "bench_tuned", bench_s + 60)
    print(f"== done, {float(os.environ.get('DEADLINE_S', '530')) - left():.0f} s; records in {OUT / 'steps.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
