#!/usr/bin/env bash
# Issue 19 on the H200: `calibrate --quick` twice (time and spread), then the cost model's
# predicted decode b1/16/64 + prefill beside `portlayer bench` for the Qwen3-0.6B shape
# (random bf16 weights, built as benchmarks/bench_serving.py does) and a tiny model.
#
#   bash scripts/gpu_calibrate.sh              # from the repo root; results under $OUT (default ./gpu-results/calibrate)
#   STEPS=tune bash scripts/gpu_calibrate.sh   # second command: autotune the 0.6B artifact, recompile, bench both
#                                              (artifacts and cal1.json stay in ./out/calibrate-art between commands)
#   DEVICE=cpu TARGET=cpu-x86_64 LAYERS=2 VOCAB=512 bash scripts/gpu_calibrate.sh   # CPU smoke of the plumbing
#
# Prints: per calibrate run its wall time and one line per benchmark; the spread table; per model
# the bench table and "predicted vs measured" with the error in %; for STEPS=tune the per-family
# search lines (default vs best step time), the tuned plan's launch.* decisions and both benches.
set -u
cd "$(dirname "$0")/.."
source scripts/gpu_bootstrap.sh
export OUT=${OUT:-$PWD/gpu-results/calibrate} PYTHONUNBUFFERED=1
export PORTLAYER_CACHE=${PORTLAYER_CACHE:-$OUT/cache} TRANSFORMERS_OFFLINE=1
DEVICE=${DEVICE:-cuda} TARGET=${TARGET:-nvidia-h200} LAYERS=${LAYERS:-28} VOCAB=${VOCAB:-151936}
ARTS=${ARTS:-$PWD/out/calibrate-art}  # artifacts kept between commands (out/ is git-ignored); CLEAN=1 removes them
mkdir -p "$ARTS"
PY=${PYTHON:-python} STEPS=${STEPS:-calibrate predict}
mkdir -p "$OUT"
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }

compile_06b() {  # $1: output dir
  $PY - "$LAYERS" "$VOCAB" "$TARGET" "$1" <<'PYEOF'
import sys, time
sys.path.insert(0, "benchmarks")
from bench_serving import build_model
import portlayer
layers, vocab, target, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
t0 = time.perf_counter()
portlayer.compile(build_model(layers, vocab, 0), target=target, output=out, progress=False)
print(f"== compiled the Qwen3-0.6B shape ({layers} layers, vocab {vocab}) for {target} in {time.perf_counter() - t0:.1f} s")
PYEOF
}

if has calibrate; then
  for i in 1 2; do
    t0=$SECONDS
    timeout 150 $PY -m portlayer.cli calibrate --device "$DEVICE" --quick -o "$OUT/cal$i.json" 2> "$OUT/cal$i.err"
    rc=$?
    echo "== calibrate --quick run $i: rc=$rc, $((SECONDS - t0)) s wall (budget: 60 s on the H200, 90 s on the CPU)"
    grep -E "^calibrate" "$OUT/cal$i.err" | cut -c1-240
    [ $rc = 0 ] || tail -5 "$OUT/cal$i.err"
  done
  $PY - "$OUT/cal1.json" "$OUT/cal2.json" <<'PYEOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
def rows(d):
    c = d["calibration"]
    out = {"copy GB/s (largest)": d["memory"]["bandwidth_gbps"], "launch eager us": c["launch_us"]["eager_us"],
           "launch graph us": c["launch_us"]["graph_us"], "attention KV GB/s": c["attention"]["gbps"],
           "triton_gemm_max_tokens": (d.get("tuning") or {}).get("triton_gemm_max_tokens")}
    out.update({f"matmul {k} TFLOP/s": v for k, v in d["throughput_tflops"].items()})
    for k, curve in c["gemm_curves"].items():
        out.update({f"gemm {k} M={r['m']} us": r["us"] for r in curve})
    return out
ra, rb = rows(a), rows(b)
print("== spread between the two runs (|a-b| / mean)")
worst = 0.0
for k in ra:
    x, y = ra[k], rb.get(k)
    if x is None or y is None or not (x + y):
        print(f"  {k:<28} {x!s:>10} {y!s:>10}")
        continue
    s = abs(x - y) / ((x + y) / 2) * 100
    worst = max(worst, s)
    print(f"  {k:<28} {x:>10.4g} {y:>10.4g}  {s:5.1f}%")
print(f"  worst spread {worst:.1f}%")
PYEOF
fi

CAL=""
[ -f "$OUT/cal1.json" ] && cp "$OUT/cal1.json" "$ARTS/cal1.json"  # a later STEPS=tune command predicts with it too
[ -f "$ARTS/cal1.json" ] && CAL="--calibration $ARTS/cal1.json"
if has predict; then
  compile_06b "$ARTS/qwen3-0.6b"
  echo "== bench Qwen3-0.6B shape (predicted with ${CAL:-the shipped descriptor peaks})"
  timeout 240 $PY -m portlayer.cli bench "$ARTS/qwen3-0.6b" --batch 1 16 64 --context 128 --prefill-tokens 128 \
    $CAL --json "$OUT/bench-qwen3-0.6b.json" 2>&1 | tail -12
  timeout 150 $PY -m portlayer.cli compile tiny-qwen3 --target "$TARGET" -o "$ARTS/tiny" > "$OUT/compile-tiny.log" 2>&1
  echo "== compile tiny-qwen3: rc=$?"
  echo "== bench tiny-qwen3"
  timeout 120 $PY -m portlayer.cli bench "$ARTS/tiny" --batch 1 16 64 --context 128 --prefill-tokens 128 \
    $CAL --json "$OUT/bench-tiny.json" 2>&1 | tail -12
fi

if has tune; then  # autotune on the 0.6B shape, then a second compile that only reads the tuning file
  export PORTLAYER_TUNING="$OUT/tuning.json"
  rm -f "$PORTLAYER_TUNING"
  [ -f "$ARTS/qwen3-0.6b/manifest.json" ] || compile_06b "$ARTS/qwen3-0.6b"  # the default-config artifact
  echo "== portlayer tune (decode batch 16 + prefill 128 per candidate)"
  t0=$SECONDS
  timeout 360 $PY -m portlayer.cli tune "$ARTS/qwen3-0.6b" --batch 16 --iters 5 --candidates ${CANDIDATES:-4} \
    --families ${FAMILIES:-gemm gemv attention_decode attention_prefill reduction} -o "$PORTLAYER_TUNING" 2>&1 | tail -12
  echo "   tune: $((SECONDS - t0)) s"
  compile_06b "$ARTS/tuned"
  $PY - "$ARTS/tuned/plan.json" <<'PYEOF'
import json, sys
for d in json.load(open(sys.argv[1]))["decisions"]:
    if d["name"].startswith("launch."):
        print(f"  {d['name']:<26} {json.dumps(d['value'])}  <- {d['reason'][:160]}")
PYEOF
  for art in qwen3-0.6b tuned; do
    echo "== bench $art"
    timeout 150 $PY -m portlayer.cli bench "$ARTS/$art" --batch 1 16 64 $CAL --json "$OUT/bench-$art.json" 2>&1 | tail -6
  done
fi
[ -n "${CLEAN:-}" ] && rm -rf "$ARTS"
rm -rf "$OUT/cache"
