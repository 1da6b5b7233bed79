#!/usr/bin/env bash
# Issue 20, the load's hash check beside the weights' copy (runtime/loaded.py): one artifact (8B by default)
# compiled once, then loaded four times in fresh processes, alternating PORTLAYER_VERIFY_WAIT=1 (the blocking
# check: every chunk hashed, then the weights mapped and copied) and the default (hashed while copied, joined
# before the executable is returned); the last default load also validates. One line per load:
#   blocking 1 verify_s .. load_s ..   (load_s: portlayer.load + executable(), the bench's figure; goal <= 6 s)
# $OUT/load_overlap_*.json hold the bench's rows. About 2 min for the checkpoint and compile + 4 x ~15 s here.
#   bash scripts/gpu_load_overlap.sh
#   PARAMS=tiny TARGET=cpu-x86_64 bash scripts/gpu_load_overlap.sh   # the plumbing, on any machine
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu-results} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
PARAMS=${PARAMS:-8B}
TARGET=${TARGET:-nvidia-h200}
WORK=${GPU_LOAD_WORK:-/tmp/load-overlap-work}
mkdir -p "$OUT"
git log -1 --format='commit %H' 2>/dev/null || true
if [ ! -f "$WORK/art-$TARGET/manifest.json" ]; then
  python benchmarks/bench_scale.py --params "$PARAMS" --targets "$TARGET" --work "$WORK" --keep --no-load \
    --json "$OUT/load_overlap_compile.json" > /dev/null 2> "$OUT/load_overlap_compile.err" \
    || { echo "compile failed:"; tail -20 "$OUT/load_overlap_compile.err"; exit 1; }
fi
for i in 1 2; do
  for mode in blocking overlap; do
    extra=()
    if [ "$mode" = blocking ]; then export PORTLAYER_VERIFY_WAIT=1; else unset PORTLAYER_VERIFY_WAIT; fi
    [ "$mode" = overlap ] && [ "$i" = 2 ] && extra=(--validate)
    J="$OUT/load_overlap_${mode}_$i.json"
    rm -f "$J"
    python benchmarks/bench_scale.py --params "$PARAMS" --targets "$TARGET" --work "$WORK" --keep --serve-only \
      ${extra[@]+"${extra[@]}"} --label "$mode" --json "$J" > /dev/null 2> "$OUT/load_overlap_${mode}_$i.err"
    python - "$J" "$mode" "$i" <<'EOF'
import json, sys
path, mode, i = sys.argv[1:]
try:
    r = json.load(open(path))["rows"][0]["load"]
except Exception as e:  # noqa: BLE001 - say what is missing, keep going
    print(mode, i, "no result:", e)
    raise SystemExit(0)
v = r.get("validate", {}).get("ok")
print(mode, i, "verify_s", r.get("verify_s"), "load_s", r.get("load_s"), "cpu_s", r.get("cpu_s"),
      "peak_rss_gib", round(r.get("peak_rss", 0) / 2**30, 2), "" if v is None else f"validate_ok {v}", r.get("error", ""))
EOF
  done
done
unset PORTLAYER_VERIFY_WAIT
