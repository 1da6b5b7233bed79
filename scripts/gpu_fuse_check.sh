#!/usr/bin/env bash
# Issue 12 lever 1 on the H200, one device call (<= 5 min): the Qwen3-0.6B shape (random bf16 weights, as
# benchmarks/bench_serving.py builds it) compiled for nvidia-h200, decode timed at batch 1/16/64 (CUDA-graph
# replay, bench_serving's decode mode), then `portlayer validate` on the same artifact, and the launches per
# decoder layer at decode batch 1 read from the generated program. Results under $OUT:
#   bench06.json (decode step_ms / tok/s per batch, compile and load times), validate06.json, launches.json.
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu-results} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=$PWD
export PORTLAYER_CACHE=${PORTLAYER_CACHE:-/tmp/plcache-fuse}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
git log -1 --format='commit %H' 2>/dev/null || true
art=/tmp/art06-fuse
rm -rf "$art"
echo "== Qwen3-0.6B shape, bf16: compile for nvidia-h200, decode b1/b16/b64"
timeout 240 python benchmarks/bench_serving.py --compile-target nvidia-h200 --artifact-out "$art" \
  --decode-batches 1,16,64 --decode-steps 32 --skip-serving --json "$OUT/bench06.json" 2> "$OUT/bench06.err" | tail -5
grep -E "decode:|compile" "$OUT/bench06.err" | tail -4
echo "== validate"
timeout 120 python -m portlayer.cli validate "$art" --json "$OUT/validate06.json" 2>&1 | tail -4
echo "== launches per decoder layer at decode batch 1 (recorded from a real eager decode step, graphs off)"
timeout 120 python - "$art" "$OUT/launches.json" <<'PY'
import collections, json, os, sys
from portlayer.codegen import kernel_binaries as KB
from portlayer.runtime.engine import LLMEngine
from portlayer.runtime.sequence import SamplingParams

launches = []
bind = KB.bind


class Recorder:
    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            launches.append(self.name)
            return self.fn[grid](*args, **kwargs)
        return launch


KB.bind = lambda fns, sources, device: {n: Recorder(n, f) for n, f in bind(fns, sources, device).items()}
eng = LLMEngine.from_artifact(sys.argv[1], enable_prefix_caching=False, interpret=os.environ.get("TRITON_INTERPRET") == "1")
eng.executable.use_graphs = False
eng.generate([[5, 17, 42, 99, 3]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
starts = [i for i, n in enumerate(launches) if n.startswith("embedding_")]
decode = launches[starts[-1]:]
counts = collections.Counter(decode)
att = [i for i, n in enumerate(decode) if n.startswith("attn_decode_") and not n.endswith("_reduce")]  # one a layer
per_layer = att[1] - att[0]  # one layer's period: attention of layer 0 up to attention of layer 1
out = {"decode_b1_launches": len(decode), "per_layer": per_layer, "layers": len(att),
       "one_layer": decode[att[0]:att[1]], "counts": dict(counts)}
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[2], "w"), indent=1)
PY
echo "== done (results in $OUT)"
