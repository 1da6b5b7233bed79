"""On a GPU: the runtime's hard cases through generated Triton programs.

tiny Llama and tiny Qwen3 compiled for the local descriptor in float32; greedy tokens from the
engine compared with HF's own greedy decoding with its KV cache on the same GPU (a manual loop:
on near-ties `generate` was seen to pick differently from the model's own forward), for 8
prompts of lengths 1..200:
(a) all submitted together with prefix caching (two prompts share a 64-token prefix) and
chunked prefill (chunk 16); (b) a KV budget so small that preemption must happen.
Prints one JSON line per case and writes $OUT/gpu_runtime_check.json.

    python scripts/gpu_runtime_check.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from _bootstrap import bootstrap  # noqa: E402

bootstrap()
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import portlayer  # noqa: E402
from portlayer.builtin_models import resolve_model  # noqa: E402
from portlayer.runtime.engine import LLMEngine  # noqa: E402
from portlayer.runtime.sequence import SamplingParams  # noqa: E402

LENS = (1, 7, 33, 64 + 10, 64 + 25, 120, 160, 200)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    out = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENS]
    shared = torch.randint(0, vocab, (64,), generator=g).tolist()
    out[3] = shared + out[3][64:]  # two prompts sharing a 64-token prefix
    out[4] = shared + out[4][64:]
    return out


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int, dev: str) -> list[int]:
    """HF's forward with its KV cache, argmax each step (what greedy generation means)."""
    out = model(torch.tensor([prompt], device=dev), use_cache=True)
    past, toks = out.past_key_values, []
    for _ in range(n):
        toks.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[toks[-1]]], device=dev), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return toks


def main() -> int:
    from transformers import AutoModelForCausalLM

    results = {}
    tmp = Path(tempfile.mkdtemp())
    for name in ("tiny-llama", "tiny-qwen3"):
        path = resolve_model(name)
        art = tmp / name
        portlayer.compile(str(path), target="auto", output=art, dtype="float32", progress=False)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        hf = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval().to(dev)
        ps = prompts(hf.config.vocab_size)
        refs = [hf_greedy(hf, p, 32, dev) for p in ps]
        cases = {
            "prefix+chunk16": dict(enable_prefix_caching=True, prefill_chunk_size=16),
            "tiny-kv-preempt": dict(enable_prefix_caching=False, kv_cache_budget_bytes=None, num_blocks_hint=24),
        }
        for case, kw in cases.items():
            hint = kw.pop("num_blocks_hint", None)
            if hint:  # bytes for `hint` blocks of this model's cache
                probe = LLMEngine.from_artifact(art)
                per_block = sum(k.numel() * k.element_size() * 2 for k, _ in probe.kv_caches) // probe.config.num_blocks
                kw["kv_cache_budget_bytes"] = per_block * hint
                del probe
            eng = LLMEngine.from_artifact(art, **kw)
            sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
            if kw.get("enable_prefix_caching"):  # cache the shared prefix first, then submit everything
                eng.generate([ps[3]], sp)
            outs = eng.generate(ps, sp)
            equal = [o.token_ids == r for o, r in zip(outs, refs)]
            r = {"equal": equal, "program": type(eng.executable).__name__, **eng.stats}
            results[f"{name}/{case}"] = r
            print(name, case, json.dumps(r), flush=True)
    Path(os.environ.get("OUT", "."), "gpu_runtime_check.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
