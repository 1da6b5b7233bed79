#!/usr/bin/env bash
# Issue 12 lever 6 on the H200 (< 5 min): the Qwen3-0.6B shape compiled bf16 / int8 / int4 (RTN), decode
# at batch 1/16/64 with 512 cached tokens, launches per batch-1 step, `portlayer validate` on int8 and int4.
# Writes $OUT/quant_decode_h200.json (scripts/gpu_quant_decode.py says what is in it).
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 560 python scripts/gpu_quant_decode.py "$@" 2>&1 | grep -v "^\[portlayer\] \(stage\|wrote\)" | tail -80
