#!/usr/bin/env bash
# Kernel binaries made on the CPU machine load and run on the H200 without the Triton compiler.
#
#   bash scripts/gpu_binaries.sh build   # on the CPU machine (no GPU): compile tiny-qwen3 for nvidia-h200 into
#                                        # scripts/gpu_binaries/tiny-qwen3-h200 (cubins by triton 3.9 + ptxas 12.9)
#   bash scripts/gpu_binaries.sh         # on the H200 (triton 3.6): load that artifact with TRITON_CACHE_DIR an
#                                        # empty READ-ONLY directory and triton.compile / JIT runs trapped;
#                                        # validate it, serve 8 requests, print first-request ms
#
# Prints one JSON line per check and "GPU_BINARIES: PASS" or "GPU_BINARIES: FAIL ..."; writes
# $OUT/gpu_binaries.json when OUT is set. Needs no network and no pip.
set -euo pipefail
cd "$(dirname "$0")/.."
ART=${ART:-.devcarry/gpu_binaries/tiny-qwen3-h200}  # built here by `build` (git-ignored, carried to the H200)
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [[ "${1:-run}" == "build" ]]; then
  rm -rf "$ART"
  mkdir -p "$(dirname "$ART")"
  PORTLAYER_CACHE="$(mktemp -d)" "$PY" -m portlayer.cli compile tiny-qwen3 --target nvidia-h200 --dtype bfloat16 \
    -o "$ART" --no-progress
  du -sh "$ART"
  exit 0
fi

RO="$(mktemp -d)"
chmod 555 "$RO"
export TRITON_CACHE_DIR="$RO" PORTLAYER_CACHE="$(mktemp -d)" HF_HUB_OFFLINE=1
"$PY" - "$ART" <<'EOF'
import json, os, sys, time
from pathlib import Path

art = Path(sys.argv[1])
out = {"artifact": str(art), "triton_cache_dir": os.environ["TRITON_CACHE_DIR"]}
import torch, triton
out.update(torch=torch.__version__, triton=triton.__version__, device=torch.cuda.get_device_name(0))
print(json.dumps({"check": "environment", "torch": out["torch"], "triton": out["triton"], "device": out["device"]}),
      flush=True)
compiles = []
import triton.compiler.compiler as tcc
from triton.runtime import jit as tjit
real_compile = tcc.compile
def trapped_compile(*a, **k):
    compiles.append(str(a[0])[:80] if a else "?")
    raise RuntimeError("triton.compile called: the artifact's binaries were not used")
tcc.compile = triton.compile = trapped_compile
real_run = tjit.JITFunction.run
def trapped_run(self, *a, **k):
    compiles.append(f"JIT run of {self.__name__}")
    raise RuntimeError(f"Triton JIT launch of {self.__name__}: the artifact's binary was not used")
tjit.JITFunction.run = trapped_run

manifest = json.loads((art / "manifest.json").read_text())
b = manifest.get("binaries") or {}
out["binaries"] = {"kind": b.get("kind"), "kernels": len(b.get("kernels", {})), "toolchain": b.get("toolchain")}
print(json.dumps({"check": "manifest", **out["binaries"]}), flush=True)

from portlayer.loaded import open_artifact
from portlayer.codegen.kernel_binaries import BinaryKernel
t0 = time.perf_counter()
loaded = open_artifact(art)
exe = loaded.executable()
torch.cuda.synchronize()
out["load_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
prog = getattr(exe, "program", exe)
K = getattr(prog, "K", None) or getattr(getattr(exe, "prog", None), "K", None)
kinds = sorted({type(v).__name__ for v in vars(K).values()}) if K is not None else ["?"]
out["kernel_objects"] = kinds
print(json.dumps({"check": "load", "ms": out["load_ms"], "kernel_objects": kinds}), flush=True)
report = loaded.validate(exe)
out["validate_ok"] = bool(report.ok)
print(report.format_table(), flush=True)

from portlayer.runtime.engine import LLMEngine
from portlayer.runtime.sequence import SamplingParams
eng = LLMEngine.from_artifact(art)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 17, 33, 64, 1, 9, 100, 120)]
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
t0 = time.perf_counter()
first = eng.generate([prompts[0]], params)
torch.cuda.synchronize()
out["first_request_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
t0 = time.perf_counter()
rest = eng.generate(prompts, params)
torch.cuda.synchronize()
out["eight_requests_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
# the same artifact's kernels through Triton's JIT (sources) must give the same greedy tokens
tjit.JITFunction.run, tcc.compile, triton.compile = real_run, real_compile, real_compile
os.environ["PORTLAYER_KERNEL_BINARIES"] = "0"
os.environ["TRITON_CACHE_DIR"] = str(Path(os.environ["PORTLAYER_CACHE"]) / "triton-jit")
jit = LLMEngine.from_artifact(art).generate(prompts, params)
out["tokens_equal_jit"] = [a.token_ids for a in rest] == [b.token_ids for b in jit]
out["triton_compiles_with_binaries"] = compiles
out["triton_cache_entries"] = len(os.listdir(out["triton_cache_dir"]))
print(json.dumps({"check": "serve", "first_request_ms": out["first_request_ms"], "eight_requests_ms":
                  out["eight_requests_ms"], "tokens_equal_jit": out["tokens_equal_jit"],
                  "triton_compiles": len(compiles), "ro_cache_entries": out["triton_cache_entries"]}), flush=True)
ok = (out["validate_ok"] and not compiles and out["tokens_equal_jit"] and out["first_request_ms"] <= 100
      and out["triton_cache_entries"] == 0 and set(kinds) <= {"BinaryKernel", "BinaryVariants"})
if os.environ.get("OUT"):
    Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
    (Path(os.environ["OUT"]) / "gpu_binaries.json").write_text(json.dumps(out, indent=1))
print("GPU_BINARIES:", "PASS" if ok else f"FAIL {json.dumps(out)}")
sys.exit(0 if ok else 1)
EOF
