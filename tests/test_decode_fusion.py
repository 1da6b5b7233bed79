"""Decode-time fusions of the few-rows GEMM (issue 12 lever 1), checked on real runs.

The nvidia-h200 program of small Llama / Qwen3 / Qwen2 / Phi-3 configs (odd hidden sizes that no block
divides, MQA, head_dim 16/32/64, q/k norm, QKV biases, tied embeddings, fused qkv/gate_up weights) runs under the Triton
interpreter: its launches per decoder layer at decode batch 1 are counted from the kernels the
program really calls (a model with one more layer makes that many more launches), and greedy tokens
equal HF generate at decode batch 1 (the fused few-rows kernels: norm prologue, Q|K|V and gate|up
in one launch each) and at batch 3 (above tuning.gemv_max_tokens: the norm kernel, then cuBLAS).
"""

from __future__ import annotations

import re

import pytest
import torch
from triton_harness import h200_few_sms, tiny_causal_lm

import portlayer
from portlayer.codegen import kernel_binaries as KB

pytestmark = pytest.mark.interpreter

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=40, intermediate_size=88, num_attention_heads=2, num_key_value_heads=1, head_dim=32)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(hidden_size=48, intermediate_size=72, num_attention_heads=2, num_key_value_heads=1, head_dim=64)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(hidden_size=48, intermediate_size=72, num_attention_heads=3, num_key_value_heads=1,
                   tie_word_embeddings=True)),
    # one fused qkv_proj / gate_up_proj weight: the single-linear few-rows kernel with the norm prologue
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(hidden_size=48, intermediate_size=72, num_attention_heads=3, num_key_value_heads=1, pad_token_id=0,
                  eos_token_id=1, bos_token_id=2)),
}
VOCAB = 96
PROMPTS = [[5, 17, 42, 90, 3], [7, 8, 9], [60, 1, 64, 33]]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF model, float32 artifact for nvidia-h200 with 4 SMs, its source dir) per (arch, layers)."""
    from portlayer.flatten.tokenizer import write_byte_tokenizer

    out = {}
    root = tmp_path_factory.mktemp("decode-fusion")
    target = h200_few_sms(root)  # 4 SMs: the same kernels (test_the_h200_program_launches_the_same_kernels)
    for arch, layers in [("llama", 2), ("llama", 3), ("qwen3", 2), ("qwen3", 3), ("qwen2", 2), ("phi3", 2)]:
        cfg_name, model_name, kw = ARCHS[arch]
        model = tiny_causal_lm(cfg_name, model_name, VOCAB, layers, **kw)
        src = root / f"{arch}-{layers}"
        model.save_pretrained(str(src))
        write_byte_tokenizer(src, vocab_size=VOCAB)
        art = root / f"{arch}-{layers}-h200"
        portlayer.compile(str(src), target=str(target), dtype="float32", output=art, progress=False,
                          sources_only=True, verify=False)
        out[(arch, layers)] = (model, art, src)
    return out


def _launched(host: str) -> list[str]:
    return re.findall(r"K\.(\w+)\[", host)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_the_h200_program_launches_the_same_kernels(built, tmp_path, arch):
    _, art, src = built[(arch, 2)]
    real = tmp_path / "h200"
    portlayer.compile(str(src), target="nvidia-h200", dtype="float32", output=real, progress=False,
                      sources_only=True, verify=False)
    assert _launched((real / "host.py").read_text()) == _launched((art / "host.py").read_text())


def _engine(art, monkeypatch, launches: list[tuple[str, tuple]]):
    from portlayer.runtime.engine import LLMEngine

    class Recorder:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.name, tuple(grid)))
                return self.fn[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(KB, "bind", lambda fns, sources, device: {n: Recorder(n, f) for n, f in fns.items()})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return LLMEngine.from_artifact(art, interpret=True)


def _decode_launches(art, monkeypatch) -> list[str]:
    """The kernels of the decode step at batch 1 of a 2-token run: every forward starts with the
    token embedding's launch, its grid (T,) says how many tokens the step runs."""
    from portlayer.runtime.sequence import SamplingParams

    launches: list[tuple[str, tuple]] = []
    eng = _engine(art, monkeypatch, launches)
    eng.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    starts = [i for i, (n, _) in enumerate(launches) if n.startswith("embedding_")]
    assert len(starts) == 2 and launches[starts[0]][1] == (len(PROMPTS[0]),) and launches[starts[1]][1] == (1,), launches
    return [n for n, _ in launches[starts[1]:]]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_launches_per_decoder_layer_at_decode_batch_1(built, monkeypatch, arch):
    two = _decode_launches(built[(arch, 2)][1], monkeypatch)
    three = _decode_launches(built[(arch, 3)][1], monkeypatch)
    per_layer = len(three) - len(two)
    # norm+Q|K|V, rope(+q/k norm)+KV write, attention, its reduce, o_proj, norm+gate|up+silu*mul, down
    assert per_layer == 7, (per_layer, three)
    assert not any(n.startswith("reduction_") for n in three[1:-2]), three  # no norm launch inside the layers
    assert not any(n.startswith(("pointwise_", "reshape_and_cache")) for n in three), three


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False)
    return gen[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "phi3"])
def test_greedy_equals_hf_below_and_above_the_rows_rule(built, monkeypatch, arch):
    from portlayer.runtime.sequence import SamplingParams

    model, art, _ = built[(arch, 2)]
    eng = _engine(art, monkeypatch, [])
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    one = eng.generate([PROMPTS[0]], params)[0]  # decode at 1 row: the fused few-rows kernels
    assert list(one.token_ids) == _hf_greedy(model, PROMPTS[0], 3)
    three = eng.generate(PROMPTS, params)  # decode at 3 rows: norm kernel + vendor GEMMs
    for prompt, out in zip(PROMPTS, three):
        assert list(out.token_ids) == _hf_greedy(model, prompt, 3), prompt
