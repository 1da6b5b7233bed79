#!/usr/bin/env bash
# The batched H200 check: artifacts through the full pipeline (compile/validate/bench, cache,
# wrong-device refusal), then the serving benchmark on the generated Triton program of the
# Qwen3-0.6B-shaped model, then `portlayer validate` of that artifact. Results under $OUT.
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu-results} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -n "${SKIP_VALIDATE:-}" ] || timeout 200 bash scripts/gpu_validate.sh > "$OUT/gpu_validate.log" 2>&1; echo "gpu_validate rc=$?"
grep -E "^!!|== done|PASSED|FAILED|cache hit" "$OUT/gpu_validate.log" | head -30
timeout 330 python benchmarks/bench_serving.py --compile-target ${COMPILE_TARGET:-nvidia-h200} --artifact-out "$OUT/art-qwen3-0.6b" \
  --time-limit ${SERVE_LIMIT:-150} --json "$OUT/bench_serving.json" "$@" 2> "$OUT/bench_serving.err" | tail -60
echo "bench rc=$?"; grep "\[bench\]" "$OUT/bench_serving.err" | cut -c1-400
tail -5 "$OUT/bench_serving.err"
timeout 60 python -m portlayer.cli validate "$OUT/art-qwen3-0.6b" --json "$OUT/validate-qwen3-0.6b.json" 2>&1 | tail -12
rm -rf "$OUT/art-qwen3-0.6b" "$OUT"/art-* "$OUT/cache"
