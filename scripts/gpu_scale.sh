#!/usr/bin/env bash
# Issue 20 on the H200 host (16 cores, 128 GB RAM, 64 GiB disk, 10 min per command): a random-weight
# Llama-shaped checkpoint built, compiled for nvidia-h200 (compile s, peak RSS vs 1.25x weights + 2 GB),
# loaded (s; target <= 6 s) and decode-timed at batch 1 (ms/step vs the weight-read floor), in one command.
# $OUT/scale_<params>_h200.json is rewritten after each stage (checkpoint, compile, load, decode), so a
# timeout still leaves the stages that finished.
#   bash scripts/gpu_scale.sh                 # 8B (16 GB): checkpoint and artifact both on the disk
#   PARAMS=32B bash scripts/gpu_scale.sh      # 32B (61 GiB): checkpoint in /dev/shm, artifact on the disk
#   PARAMS=tiny GPU_SCALE_TARGET=cpu-x86_64 bash scripts/gpu_scale.sh   # the plumbing, on any machine
# 32B: checkpoint + artifact (2 x 61 GiB) do not fit the 64 GiB disk, so the checkpoint is built in
# /dev/shm (tmpfs: RAM, half of it by default = 64 GiB) and deleted after the compile, before the load;
# the compile maps it (no copy: flatten/checkpoint.py). Before anything is built the script checks the
# free space of both places and RAM, and if they cannot hold it writes {"status": "does not fit", ...}
# with the figures and exits 3.
# Two calls (32B: each within 9 minutes): STAGE=compile builds the checkpoint, compiles and keeps the
# artifact in $GPU_SCALE_WORK (checkpoint dropped); STAGE=serve loads, validates and decodes b1 from it,
# then removes it. STAGE=auto (the default) is both in one call for 8B and smaller; for 32B it is serve
# when a kept artifact is there, else compile. A serve call that lands on a fresh machine (no artifact:
# /tmp does not survive a new machine) says so in the JSON and exits 4.
#   PARAMS=32B bash scripts/gpu_scale.sh; PARAMS=32B bash scripts/gpu_scale.sh   # compile, then serve
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu-results} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
PARAMS=${PARAMS:-8B}
TARGET=${GPU_SCALE_TARGET:-nvidia-h200}
LIMIT=${GPU_SCALE_LIMIT_S:-540}
JSON="$OUT/scale_${PARAMS}_h200.json"
[ "$TARGET" = nvidia-h200 ] || JSON="$OUT/scale_${PARAMS}_${TARGET}.json"
if [ "$PARAMS" = 32B ]; then CKPT_ROOT=${BENCH_CACHE:-/dev/shm/portlayer-bench}; DROP=--drop-checkpoint
else CKPT_ROOT=${BENCH_CACHE:-/tmp/portlayer-bench}; DROP=; fi
WORK=${GPU_SCALE_WORK:-/tmp/bench-scale-work}
STAGE=${STAGE:-auto}
if [ "$STAGE" = auto ]; then
  if [ "$PARAMS" != 32B ]; then STAGE=all
  elif [ -f "$WORK/art-$TARGET/manifest.json" ] && [ -f "$WORK/KEPT" ]; then STAGE=serve
  else STAGE=compile; fi
fi
case "$STAGE" in all|compile|serve) ;; *) echo "STAGE=$STAGE: use auto, all, compile or serve"; exit 2;; esac
echo "== stage: $STAGE"
mkdir -p "$OUT" "$CKPT_ROOT"
if [ "$STAGE" = serve ]; then
  if [ ! -f "$WORK/art-$TARGET/manifest.json" ] || [ ! -f "$WORK/KEPT" ]; then
    echo "NO ARTIFACT: $WORK/art-$TARGET is not here (this call landed on a fresh machine, or the compile stage did" \
         "not finish); run STAGE=compile first, then STAGE=serve on the same warm machine"
    printf '{"benchmark": "bench_scale", "params": "%s", "status": "no artifact to serve", "why": "%s missing: a fresh machine, or the compile stage did not finish"}\n' \
      "$PARAMS" "$WORK/art-$TARGET" > "$OUT/scale_${PARAMS}_serve.json"
    exit 4
  fi
  cp "$WORK/scale.json" "$JSON" 2>/dev/null || true
else
  rm -rf "$WORK"; mkdir -p "$WORK"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
git log -1 --format='commit %H' 2>/dev/null || true
df -h "$CKPT_ROOT" "$WORK" | sed 1d
free -g | head -2

# ---- does it fit? (checkpoint bytes from the shapes; the artifact holds the same bf16 bytes) ----------
# (serve: the artifact is already on the disk and the checkpoint gone; nothing more is written)
[ "$STAGE" = serve ] || python - "$PARAMS" "$CKPT_ROOT" "$WORK" "$JSON" "$DROP" <<'EOF'
import json, math, os, shutil, sys
sys.path.insert(0, "benchmarks")
from bench_scale import llama_config, tensor_shapes
params, ckpt_root, work, out, drop = sys.argv[1:6]
nbytes = sum(2 * math.prod(s) for _, s in tensor_shapes(llama_config(params)))
gib = 1 << 30
built = any(os.path.isfile(os.path.join(ckpt_root, d, "DONE")) for d in os.listdir(ckpt_root)
            if d.startswith(f"llama-{params}-"))
need_ckpt = 0 if built else nbytes + gib
need_art = nbytes + 2 * gib
free_ckpt, free_art = shutil.disk_usage(ckpt_root).free, shutil.disk_usage(work).free
same_fs = os.stat(ckpt_root).st_dev == os.stat(work).st_dev
mem = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/meminfo")}
in_ram = ckpt_root.startswith("/dev/shm")
need_ram = (nbytes if in_ram else 0) + 0.25 * nbytes + 2 * gib  # tmpfs pages + the compile's bound beyond the map
rows = {"weight_gib": round(nbytes / gib, 2), "checkpoint_root": ckpt_root, "work": work,
        "free_gib": {"checkpoint_root": round(free_ckpt / gib, 1), "work": round(free_art / gib, 1)},
        "need_gib": {"checkpoint": round(need_ckpt / gib, 1), "artifact": round(need_art / gib, 1),
                     "ram": round(need_ram / gib, 1)},
        "mem_available_gib": round(mem.get("MemAvailable", 0) / gib, 1), "same_filesystem": same_fs}
problems = []
if same_fs and need_ckpt + need_art > free_art:
    problems.append(f"checkpoint + artifact need {(need_ckpt + need_art) / gib:.1f} GiB on one filesystem, "
                    f"{free_art / gib:.1f} GiB free")
elif not same_fs:
    if need_ckpt > free_ckpt:
        problems.append(f"the checkpoint needs {need_ckpt / gib:.1f} GiB in {ckpt_root}, {free_ckpt / gib:.1f} GiB free")
    if need_art > free_art:
        problems.append(f"the artifact needs {need_art / gib:.1f} GiB in {work}, {free_art / gib:.1f} GiB free")
if need_ram > mem.get("MemAvailable", 0) + (nbytes if built and in_ram else 0):
    problems.append(f"RAM: {need_ram / gib:.1f} GiB needed (tmpfs checkpoint + compile), "
                    f"{mem.get('MemAvailable', 0) / gib:.1f} GiB available")
print(json.dumps(rows))
if problems:
    json.dump({"benchmark": "bench_scale", "params": params, "status": "does not fit", "why": problems, **rows},
              open(out, "w"), indent=1)
    print("DOES NOT FIT:", "; ".join(problems))
    sys.exit(3)
EOF
fit=$?
if [ $fit -ne 0 ]; then echo "rc=$fit (see $JSON)"; exit $fit; fi

LOG="$OUT/scale_${PARAMS}_$STAGE"
case "$STAGE" in
  all)     echo "== $PARAMS: build (cached in $CKPT_ROOT), compile $TARGET, load, decode b1"
           ARGS=(--decode --validate $DROP);;
  compile) echo "== $PARAMS: build (cached in $CKPT_ROOT), compile $TARGET; the artifact is kept in $WORK for STAGE=serve"
           ARGS=(--no-load --keep $DROP);;
  serve)   echo "== $PARAMS: load, validate, decode b1 of the kept artifact $WORK/art-$TARGET"
           ARGS=(--serve-only --decode --validate);;
esac
timeout "$LIMIT" python benchmarks/bench_scale.py --params "$PARAMS" --targets "$TARGET" "${ARGS[@]}" \
  --cache "$CKPT_ROOT" --work "$WORK" --label h200 --timeout "$LIMIT" --bound-extra-gib 2 \
  --json "$JSON" > "$LOG.log" 2> "$LOG.err"
echo "rc=$?"
if [ "$STAGE" = compile ]; then
  if [ -f "$WORK/art-$TARGET/manifest.json" ]; then cp "$JSON" "$WORK/scale.json"; touch "$WORK/KEPT"
    echo "artifact kept in $WORK/art-$TARGET ($(du -sh "$WORK/art-$TARGET" | cut -f1)); next call: STAGE=serve (or auto)"
  else echo "the compile left no artifact: see $LOG.err"; fi
fi
grep -E '^checkpoint|^\{"target"|no artifact' "$LOG.err" | cut -c1-600
python - "$JSON" <<'EOF' || tail -30 "$LOG.err"
import json, sys
d = json.load(open(sys.argv[1]))
print(f"last stage: {d.get('last_stage')}; checkpoint built in {d.get('checkpoint_s')} s")
for r in d["rows"]:
    c, lo = r.get("compile", {}), r.get("load", {})
    print(f"{d['params']} ({d.get('weight_gib')} GiB): compile {r.get('compile_s')} s {c.get('timings')}, peak RSS "
          f"{r.get('peak_rss_compile_gib')} GiB ({r.get('rss_over_weights')}x; bound {r.get('bound_gib')} GiB: "
          f"{r.get('within_bound')}), load {r.get('load_s')} s (verify {lo.get('verify_s')} s), "
          f"decode b1 {r.get('decode_b1')}, validate {lo.get('validate', {}).get('ok')}")
    for k in ("compile", "load"):
        if "error" in r.get(k, {}):
            print(k, "ERROR", r[k]["error"], r[k].get("stderr_tail", "")[-1500:])
EOF
if [ "$STAGE" != compile ]; then rm -rf "$WORK"; fi   # compile: kept for the serve call
if [ "$PARAMS" = 32B ]; then rm -rf "$CKPT_ROOT"; fi
exit 0
