#!/usr/bin/env bash
# Issue 19 on the H200 in ONE command (<= 9 minutes): calibrate --quick twice (spread), compile the
# Qwen3-0.6B shape and tiny-qwen3 with the calibrated descriptor, bench beside predicted (b1/16/64 +
# prefill 128), autotune the 0.6B artifact in the time left, recompile with the tuning file (its plan
# names the tuned entries; no tuning time) and bench tuned vs default. Each step under a timeout cut
# from one deadline (DEADLINE_S, default 530 s); $OUT/steps.json is rewritten after every step.
#
#   bash scripts/gpu_calibrate.sh                    # from the repo root; results under $OUT (default ./gpu-results/calibrate)
#   DEVICE=cpu bash scripts/gpu_calibrate.sh         # CPU smoke of every step (tune under the Triton interpreter)
#
# Prints per step its rc and wall time and the tail of its output (calibrate's progress lines, bench's
# "predicted vs measured" table, tune's per-family lines, the tuned plan's launch.* decisions), then
# the spread table and the per-family default vs tuned times. See scripts/gpu_calibrate.py.
set -u
cd "$(dirname "$0")/.."
source scripts/gpu_bootstrap.sh
export OUT=${OUT:-$PWD/gpu-results/calibrate} PYTHONUNBUFFERED=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT"
export PORTLAYER_CACHE=${PORTLAYER_CACHE:-$OUT/cache}
[ "${DEVICE:-cuda}" = cuda ] && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
${PYTHON:-python} scripts/gpu_calibrate.py
rc=$?
rm -rf "$OUT/cache"
exit $rc
