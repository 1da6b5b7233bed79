#!/usr/bin/env bash
# On the H200: a Qwen3-MoE-shaped model (random weights; hidden 2048, 128 experts, top-8,
# moe_intermediate 768, 32 query / 4 KV heads of 128 -- Qwen3-30B-A3B's layer -- with a few layers)
# compiled for the local device. Checks that the MoE groups run triton.fused_moe, that the artifact
# validates, that greedy generation equals HF generate on the same GPU (float32, so greedy tokens
# are comparable), then prints decode tok/s of a bfloat16 compile (portlayer bench).
#
#   bash scripts/gpu_moe.sh          # from the repo root; JSON and logs under $OUT (or ./gpu-results)
#
# Prints "moe fp32: generate == HF: True" and a bench table; exit 0 when every check passed.
# CPU smoke test of the script itself: MOE_SMALL=1 bash scripts/gpu_moe.sh (tiny shapes, compiled for
# nvidia-h200 and run under the Triton interpreter; no bench numbers worth reading).
set -u
PY=${PYTHON:-python}
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PORTLAYER_CACHE=${PORTLAYER_CACHE:-$OUT/cache}
export MOE_LAYERS=${MOE_LAYERS:-4} MOE_SMALL=${MOE_SMALL:-0} OUT
if [ "$MOE_SMALL" = 1 ]; then export TRITON_INTERPRET=1; fi
$PY - <<'PYEOF' 2>&1 | tee "$OUT/gpu_moe.txt"
import json, os, sys, tempfile, time, warnings
from pathlib import Path

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "benchmarks")]
from _bootstrap import bootstrap

bootstrap()
warnings.filterwarnings("ignore")
import torch
import transformers as T

import portlayer
from portlayer.bench import bench, format_report
from portlayer.runtime.loaded import open_artifact
from portlayer.runtime.sequence import SamplingParams

out_dir, layers, small = Path(os.environ["OUT"]), int(os.environ["MOE_LAYERS"]), os.environ["MOE_SMALL"] == "1"
dev = "cpu" if small else "cuda"
target = "nvidia-h200" if small else "auto"
shape = (dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4) if small else
         dict(vocab_size=8192, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
              num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8))
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
cfg = T.Qwen3MoeConfig(**shape, num_hidden_layers=layers, norm_topk_prob=True, max_position_embeddings=4096)
torch.manual_seed(0)
model = T.Qwen3MoeForCausalLM(cfg).eval()
with torch.no_grad():  # HF initialises routers and experts with tiny or zero weights: make routing real
    for m in model.modules():
        if getattr(m, "gate_up_proj", None) is not None and m.gate_up_proj.dim() == 3:
            torch.nn.init.normal_(m.gate_up_proj, std=0.02)
            torch.nn.init.normal_(m.down_proj, std=0.02)
        if type(m).__name__.lower().endswith("topkrouter"):
            torch.nn.init.normal_(m.weight, std=0.1)
tmp = Path(tempfile.mkdtemp())
result, ok = {"layers": layers}, True

t0 = time.time()
art = tmp / "moe-fp32"
portlayer.compile(model, target=target, output=art, dtype="float32", progress=False)
result["compile_s_fp32"] = round(time.time() - t0, 1)
kernels = json.loads((art / "kernels.json").read_text())["kernels"]
result["fused_moe_kernels"] = sorted(k for k in kernels if k.startswith("fused_moe"))
ok &= bool(result["fused_moe_kernels"])
tiles = [ln.strip() for ln in (art / "host.py").read_text().splitlines() if "# moe_experts:" in ln][:1]
print("moe kernels:", result["fused_moe_kernels"], "|", tiles)
loaded = open_artifact(art, interpret=True) if small else portlayer.load(art)
rep = loaded.validate()
result["validate_fp32"] = bool(rep.ok)
ok &= rep.ok
print(rep.format_table())

gen = torch.Generator().manual_seed(1)
prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in ((7, 20) if small else (7, 33, 120))]
new = 8 if small else 32
hf = model.to(dev)
hf.set_attn_implementation("eager")
hf.set_experts_implementation("eager")
ref = []
with torch.no_grad():
    for p in prompts:
        ids = torch.tensor([p], device=dev)
        o = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
        ref.append(o[0, len(p):].tolist())
hf.to("cpu")
torch.cuda.empty_cache()
engine = loaded.engine()
got = [list(o.token_ids) for o in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))]
same = [g == r for g, r in zip(got, ref)]
result["generate_equal_fp32"] = same
print("moe fp32: generate == HF:", all(same), same)
ok &= all(same)
del engine, loaded
torch.cuda.empty_cache()

t0 = time.time()
art16 = tmp / "moe-bf16"
portlayer.compile(model, target=target, output=art16, dtype="float16" if small else "bfloat16", progress=False)
result["compile_s_bf16"] = round(time.time() - t0, 1)
loaded16 = open_artifact(art16, interpret=True) if small else portlayer.load(art16)
rep16 = loaded16.validate()
result["validate_bf16"] = bool(rep16.ok)
ok &= rep16.ok
r = bench(loaded16, prefill_tokens=16, context=16, batch_sizes=(1,), warmup=0, iters=1) if small else \
    bench(loaded16, prefill_tokens=512, context=512, batch_sizes=(1, 8, 32))
result["bench_bf16"] = r
print(f"moe half precision ({layers} layers, {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}):")
print(format_report(r))
(out_dir / "gpu_moe.json").write_text(json.dumps(result, indent=1, default=str))
print("ALL OK" if ok else "SOME CHECK FAILED")
sys.exit(0 if ok else 1)
PYEOF
exit "${PIPESTATUS[0]}"
