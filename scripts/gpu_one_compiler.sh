#!/usr/bin/env bash
# The "one compiler" check on the H200, one device call: the gpu-marked tests on pipeline-generated
# programs; tiny models compiled by `portlayer compile` for nvidia-h200 (bf16 default, int8, int4) and
# validated on the GPU; the Qwen3-0.6B shape (bf16, then int8) compiled, decode-timed (batch 1 and 64)
# and validated. Results under $OUT.
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu-results} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD PORTLAYER_CACHE=/tmp/plcache
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
git log -1 --format='commit %H' 2>/dev/null || true
echo "== gpu-marked tests"
timeout 260 python -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_gpu.py tests/test_artifact_gpu.py 2>&1 | tail -12
for m in tiny-qwen3 tiny-llama; do
  for q in none int8 int4; do
    a=/tmp/art-$m-$q
    timeout 120 python -m portlayer.cli compile $m --target nvidia-h200 --quantize $q -o $a --no-progress > /tmp/c.log 2>&1 || { echo "!! compile $m $q"; tail -5 /tmp/c.log; continue; }
    echo "== validate $m $q ($(grep -o '"gemm_w[48][a-z]*_[a-z0-9_]*' $a/kernels.json | head -1))"
    timeout 120 python -m portlayer.cli validate $a --json $OUT/validate-$m-$q.json 2>&1 | tail -3
  done
done
for q in none int8; do
  echo "== Qwen3-0.6B shape, bf16, quantize=$q: compile, decode b1/b64, validate"
  timeout 280 python benchmarks/bench_serving.py --compile-target nvidia-h200 --quantize $q --artifact-out /tmp/art06-$q \
    --decode-batches 1,64 --skip-serving --json $OUT/bench06-$q.json 2> $OUT/bench06-$q.err | tail -12
  grep -E "compile|decode|tok/s" $OUT/bench06-$q.err | tail -4
  timeout 120 python -m portlayer.cli validate /tmp/art06-$q --json $OUT/validate06-$q.json 2>&1 | tail -4
  wc -l /tmp/art06-$q/host.py
done
