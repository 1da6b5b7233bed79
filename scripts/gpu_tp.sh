#!/usr/bin/env bash
# Tensor parallelism on GPUs (issue 17; the 2-GPU run is the next issue's done-when). Needs >= 2 CUDA GPUs
# (the nvidia-h200-x2 machine); with one GPU it stops after the single-rank reference and says so.
#
#   bash scripts/gpu_tp.sh                 # from the repo root; results under $OUT (or ./gpu-results-tp)
#
# Prints, per step, rc=...; the last line is "TP GPU CHECK: PASSED" or "TP GPU CHECK: FAILED (...)".
# Steps: compile tiny-llama for nvidia-h200 at TP 1 and TP 2 (bf16, NCCL); validate the TP 2 artifact on 2 ranks
# (self-spawned) against the single-device reference; greedy 24 tokens of TP 2 (self-spawned and torchrun)
# == TP 1; a killed rank stops `run` with an error.
set -u
PY=${PYTHON:-python}
OUT=${OUT:-$PWD/gpu-results-tp}
mkdir -p "$OUT"
export PORTLAYER_CACHE=${PORTLAYER_CACHE:-$OUT/cache}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fail=""
step() { echo "== $*"; "$@" 2>&1 | tee -a "$OUT/log.txt"; local rc=${PIPESTATUS[0]}; echo "   rc=$rc"; return "$rc"; }

step $PY -c "import torch, torch.distributed as d; print(torch.__version__, torch.cuda.device_count(), 'GPUs', d.is_nccl_available())"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
step $PY -m portlayer explain tiny-llama --target nvidia-h200 --tensor-parallel 2 | head -6
step $PY -m portlayer compile tiny-llama --target nvidia-h200 -o "$OUT/tp1" --no-progress || fail="$fail compile-tp1"
step $PY -m portlayer compile tiny-llama --target nvidia-h200 --tensor-parallel 2 -o "$OUT/tp2" --no-progress || fail="$fail compile-tp2"
grep -c "torch.distributed.all_reduce" "$OUT/tp2/host.py"
step $PY -m portlayer run "$OUT/tp1" --prompt-ids 5,17,42,99,3 --max-tokens 24 --ignore-eos --json > "$OUT/tp1.json" || fail="$fail run-tp1"
if [ "${NGPU:-0}" -lt 2 ]; then
  echo "TP GPU CHECK: NOT RUN (only ${NGPU:-0} GPU; needs 2: use the nvidia-h200-x2 machine)"; exit 3
fi
step $PY -m portlayer validate "$OUT/tp2" --json "$OUT/validate-tp2.json" || fail="$fail validate-tp2"
step $PY -m portlayer run "$OUT/tp2" --prompt-ids 5,17,42,99,3 --max-tokens 24 --ignore-eos --json > "$OUT/tp2.json" || fail="$fail run-tp2"
cmp -s <($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['token_ids'])" "$OUT/tp1.json") \
       <($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['token_ids'])" "$OUT/tp2.json") || fail="$fail tokens-tp2!=tp1"
TORCHRUN=${TORCHRUN:-torchrun}
step $TORCHRUN --nproc-per-node 2 -m portlayer run "$OUT/tp2" --prompt-ids 5,17,42,99,3 --max-tokens 24 --ignore-eos --json > "$OUT/torchrun.json" || fail="$fail torchrun"
grep -q token_ids "$OUT/torchrun.json" && cmp -s <(grep -o '"token_ids": \[[^]]*\]' "$OUT/tp1.json") <(grep -o '"token_ids": \[[^]]*\]' "$OUT/torchrun.json") || fail="$fail torchrun-tokens"
# a killed rank: start a long run, kill rank 1 after 20 s, expect rc != 0 within 10 s of the kill
$PY -m portlayer run "$OUT/tp2" --prompt-ids 5,17,42 --max-tokens 100000 --ignore-eos > "$OUT/kill.txt" 2>&1 &
pid=$!
sleep 20
child=$(pgrep -P "$pid" -f "spawn_main" | head -1)
echo "killing rank-1 process $child of run $pid"
t0=$(date +%s); kill -9 "$child"; wait "$pid"; rc=$?; t1=$(date +%s)
tail -2 "$OUT/kill.txt"; echo "run exited rc=$rc $((t1 - t0)) s after the kill"
{ [ "$rc" != 0 ] && [ $((t1 - t0)) -le 10 ] && grep -q "tensor-parallel group failed" "$OUT/kill.txt"; } || fail="$fail dead-rank"
if [ -z "$fail" ]; then echo "TP GPU CHECK: PASSED"; else echo "TP GPU CHECK: FAILED ($fail)"; exit 1; fi
