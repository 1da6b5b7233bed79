#!/usr/bin/env bash
# Issue 12/14 figures in one device call (H200, ~2 min): the Qwen3-0.6B shape (random bf16 weights) compiled
# for nvidia-h200: first request after load, prefill 16 x 1,024, the 256-sequence serving workload, decode at
# batch 1/16/64, `portlayer validate`, prefill at max_batched_tokens 4096, then HTTP vs offline with the
# engine-core process (scripts/gpu_server.sh; carry .whl/). Results under $OUT.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
T0=$SECONDS
timeout 200 python benchmarks/bench_serving.py --compile-target nvidia-h200 --artifact-out /tmp/art06 --first-request \
  --prefill 16x1024 --decode-batches 1,16,64 --time-limit 60 --json $OUT/bench06.json 2> $OUT/bench06.err | tail -1
grep "^\[bench\]" $OUT/bench06.err | cut -c1-600
echo "== validate at $((SECONDS - T0))s"
timeout 90 python -m portlayer.cli validate /tmp/art06 2>&1 | tail -12
echo "== prefill at max_batched_tokens 4096 at $((SECONDS - T0))s"
timeout 60 python benchmarks/bench_serving.py --artifact /tmp/art06 --prefill 16x1024 --max-batched-tokens 4096 --skip-serving \
  --decode-batches "" --json $OUT/prefill4096.json 2>&1 | grep "\[bench\] prefill"
echo "== server at $((SECONDS - T0))s"
ART=/tmp/art06 ENGINE_CORES=process timeout $((540 - (SECONDS - T0))) bash scripts/gpu_server.sh 2>&1 | tail -25
echo "== end at $((SECONDS - T0))s"
