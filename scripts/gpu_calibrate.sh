#!/usr/bin/env bash
# Issue 19 on the H200: `calibrate --quick` twice (time and spread), then the cost model's
# predicted decode b1/16/64 + prefill beside `portlayer bench` for the Qwen3-0.6B shape
# (random bf16 weights, built as benchmarks/bench_serving.py does) and a tiny model.
#
#   bash scripts/gpu_calibrate.sh            # from the repo root; results under $OUT (default ./gpu-results/calibrate)
#   DEVICE=cpu TARGET=cpu-x86_64 LAYERS=2 VOCAB=512 bash scripts/gpu_calibrate.sh   # CPU smoke of the plumbing
#
# Prints: per calibrate run its wall time and one line per benchmark; the spread table; per model
# the bench table and "predicted vs measured" with the error in %. Everything also lands in $OUT.
set -u
cd "$(dirname "$0")/.."
source scripts/gpu_bootstrap.sh
export OUT=${OUT:-$PWD/gpu-results/calibrate} PYTHONUNBUFFERED=1
export PORTLAYER_CACHE=${PORTLAYER_CACHE:-$OUT/cache} TRANSFORMERS_OFFLINE=1
DEVICE=${DEVICE:-cuda} TARGET=${TARGET:-nvidia-h200} LAYERS=${LAYERS:-28} VOCAB=${VOCAB:-151936}
PY=${PYTHON:-python}
mkdir -p "$OUT"
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

for i in 1 2; do
  t0=$SECONDS
  timeout 150 $PY -m portlayer.cli calibrate --device "$DEVICE" --quick -o "$OUT/cal$i.json" 2> "$OUT/cal$i.err"
  rc=$?
  echo "== calibrate --quick run $i: rc=$rc, $((SECONDS - t0)) s wall (the budget: 60 s on the H200)"
  grep -E "^calibrate" "$OUT/cal$i.err" | cut -c1-220
  [ $rc = 0 ] || tail -5 "$OUT/cal$i.err"
done

$PY - "$OUT/cal1.json" "$OUT/cal2.json" <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
def rows(d):
    c = d["calibration"]
    out = {"copy GB/s (largest)": d["memory"]["bandwidth_gbps"], "launch eager us": c["launch_us"]["eager_us"],
           "launch graph us": c["launch_us"]["graph_us"], "attention KV GB/s": c["attention"]["gbps"]}
    out.update({f"matmul {k} TFLOP/s": v for k, v in d["throughput_tflops"].items()})
    for k, curve in c["gemm_curves"].items():
        out.update({f"gemm {k} M={r['m']} us": r["us"] for r in curve})
    return out
ra, rb = rows(a), rows(b)
print("== spread between the two runs (|a-b| / mean)")
worst = 0.0
for k in ra:
    x, y = ra[k], rb.get(k)
    if x is None or y is None:
        print(f"  {k:<28} {x!s:>10} {y!s:>10}"); continue
    s = abs(x - y) / ((x + y) / 2) * 100
    worst = max(worst, s)
    print(f"  {k:<28} {x:>10.4g} {y:>10.4g}  {s:5.1f}%")
print(f"  worst spread {worst:.1f}%")
EOF

$PY - "$LAYERS" "$VOCAB" "$TARGET" "$OUT/art-qwen3-0.6b" <<'EOF'
import sys, time
sys.path.insert(0, "benchmarks")
from bench_serving import build_model
import portlayer
layers, vocab, target, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
t0 = time.perf_counter()
portlayer.compile(build_model(layers, vocab, 0), target=target, output=out, progress=False)
print(f"== compiled the Qwen3-0.6B shape ({layers} layers, vocab {vocab}) for {target} in {time.perf_counter() - t0:.1f} s")
EOF
echo "== bench Qwen3-0.6B shape (predicted with cal1.json's curves)"
timeout 240 $PY -m portlayer.cli bench "$OUT/art-qwen3-0.6b" --batch 1 16 64 --context 128 --prefill-tokens 128 \
  --calibration "$OUT/cal1.json" --json "$OUT/bench-qwen3-0.6b.json" 2>&1 | tail -12

timeout 120 $PY -m portlayer.cli compile tiny-qwen3 --target "$TARGET" -o "$OUT/art-tiny" > "$OUT/compile-tiny.log" 2>&1
echo "== compile tiny-qwen3: rc=$?"
echo "== bench tiny-qwen3 (predicted with cal1.json's curves)"
timeout 120 $PY -m portlayer.cli bench "$OUT/art-tiny" --batch 1 16 64 --context 128 --prefill-tokens 128 \
  --calibration "$OUT/cal1.json" --json "$OUT/bench-tiny.json" 2>&1 | tail -12
rm -rf "$OUT"/art-* "$OUT/cache"
