#!/usr/bin/env bash
# The H200 serving check of issue 14: the 256-request workload through HTTP vs the offline engine,
# with the engine in its own process (`portlayer serve --engine-core process`), then, when time
# allows, in a thread of the server (the previous design), all in one bench_server.py call.
# The Qwen3-0.6B-shaped artifact is built as before (bench_serving.py --compile-target nvidia-h200
# --artifact-out ... --skip-serving), or taken from $ART when it already holds one.
# Writes $OUT/bench_server.json (+ logs); prints the table and HTTP/offline ratios. <= 8 minutes.
#
#   bash scripts/gpu_server.sh                  # OUT defaults to ./gpu-results
#   ART=/tmp/art06 ENGINE_CORES=process bash scripts/gpu_server.sh [bench_server.py options]
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu-results} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-$(command -v python || command -v python3)}  # the interpreter of the earlier device scripts
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
if ls .whl/*.whl > /dev/null 2>&1; then  # the serving wheels the H200 host lacks (fastapi, uvicorn, pydantic, ...)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  echo "wheels rc=$?"
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
$PY -c "import fastapi, uvicorn, pydantic, httpx, prometheus_client; print('serving deps ok: fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__)" \
  || { echo "!! serving dependencies missing (bring wheels in .whl/)"; exit 1; }
ART=${ART:-/tmp/art06}
if [ ! -f "$ART/manifest.json" ]; then
  echo "== building the Qwen3-0.6B-shape artifact into $ART"
  timeout 300 $PY benchmarks/bench_serving.py --compile-target ${COMPILE_TARGET:-nvidia-h200} --artifact-out "$ART" \
    --skip-serving --decode-batches "" > "$OUT/gpu_server_compile.log" 2>&1
  echo "compile rc=$? after ${SECONDS}s"; tail -3 "$OUT/gpu_server_compile.log"
fi
[ -f "$ART/manifest.json" ] || { echo "!! no artifact in $ART"; exit 1; }
CORES=${ENGINE_CORES:-process,thread}
if [ -z "${ENGINE_CORES:-}" ] && [ "$SECONDS" -gt 230 ]; then CORES=process; echo "(compile took ${SECONDS}s: process mode only)"; fi
echo "== bench_server --compare, engine cores: $CORES (at ${SECONDS}s)"
left=$((470 - SECONDS)); [ "$left" -gt 90 ] || left=90
timeout $left $PY benchmarks/bench_server.py "$ART" --compare --engine-core "$CORES" --time-limit 70 \
  --json "$OUT/bench_server.json" "$@" 2> "$OUT/bench_server.err"
echo "bench rc=$? after ${SECONDS}s"
grep "\[bench\]\|\[portlayer\]" "$OUT/bench_server.err" | cut -c1-300
grep -i "error\|traceback" "$OUT/bench_server.err" | head -5
sleep 1
orphans=$(pgrep -f "portlayer.runtime.serve.core_process" | wc -l)
echo "engine-core processes left after the benchmark: $orphans (want 0)"
