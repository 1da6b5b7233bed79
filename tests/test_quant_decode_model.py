"""A tiny HF Qwen3 (random weights) compiled for nvidia-h200 with --quantize int4, run under TRITON_INTERPRET=1.

Two checks of the decode step at batch 1, where the fused few-rows kernels run: its logits against HF's
forward of the same model with the artifact's int4 weights dequantized here (unpacked with torch bit ops,
q * scale + offset per group; so the quantization error itself is not counted against the kernels), and
its kernel launches, counted by wrapping the program's loaded kernels, equal to the float program's
(norm + Q|K|V, rope + KV write, attention + reduce, o-proj + residual, norm + gate|up + SiLU*up, down).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from triton_harness import h200_few_sms, interpreted_decode_step, rel_err, tiny_causal_lm

import portlayer

pytestmark = pytest.mark.interpreter
PROMPT = [5, 17, 42, 90, 3]
VOCAB = 96


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF model, {quantize: artifact}) on nvidia-h200's descriptor with 4 SMs (fewer interpreted programs)."""
    from portlayer.flatten.tokenizer import write_byte_tokenizer

    root = tmp_path_factory.mktemp("quant-decode")
    target = h200_few_sms(root)
    model = tiny_causal_lm("Qwen3Config", "Qwen3ForCausalLM", VOCAB, hidden_size=64, intermediate_size=96,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    src = root / "qwen3"
    model.save_pretrained(str(src))
    write_byte_tokenizer(src, vocab_size=VOCAB)
    arts = {}
    for q in ("none", "int4"):
        arts[q] = root / f"art-{q}"
        portlayer.compile(str(src), target=str(target), dtype="float32", quantize=q, output=arts[q], progress=False,
                          sources_only=True, verify=False)
    return model, arts


def _decode(art: Path, monkeypatch) -> tuple[torch.Tensor, list[str]]:
    """Logits of the decode step after PROMPT (prefill, then one row), and the kernels that step launched."""
    logits, launches = interpreted_decode_step(art, [PROMPT], [PROMPT[-1]], monkeypatch)
    return logits[-1], launches


def _dequantized_hf(model, art: Path):
    """The HF model with each linear weight the artifact quantized replaced by its dequantized form."""
    import copy

    deq = copy.deepcopy(model)
    f = safe_open(str(art / "weights.safetensors"), "pt")
    keys = set(f.keys())
    done = 0
    for name, p in deq.named_parameters():
        base = name.replace(".", "_")
        if f"{base}_q4" not in keys:
            continue
        packed = f.get_tensor(f"{base}_q4").to(torch.int16)
        n = packed.shape[0]
        q = torch.stack(((packed & 0xF) - 8, (packed >> 4) - 8), dim=-1).reshape(n, -1).double()
        s = f.get_tensor(f"{base}_scales").double()
        o = f.get_tensor(f"{base}_offsets").double() if f"{base}_offsets" in keys else torch.zeros_like(s)
        g = q.shape[1] // s.shape[1]
        w = q.reshape(n, -1, g) * s[:, :, None] + o[:, :, None]
        assert w.shape[0] * w.shape[1] * w.shape[2] == p.numel()
        p.data = w.reshape(p.shape).float()
        done += 1
    assert done == 2 * 7, done  # every projection of both layers (the LM head stays float)
    return deq


@pytest.fixture(scope="module")
def decoded(built):
    """{quantize: (decode-step logits, kernels launched)}: each program run once for the tests below."""
    with pytest.MonkeyPatch.context() as mp:
        return {q: _decode(art, mp) for q, art in built[1].items()}


def test_int4_decode_logits_match_hf_with_the_dequantized_weights(built, decoded):
    model, arts = built
    ours, _ = decoded["int4"]
    with torch.no_grad():
        want = _dequantized_hf(model, arts["int4"])(torch.tensor([PROMPT + [PROMPT[-1]]])).logits[0, -1]
        original = model(torch.tensor([PROMPT + [PROMPT[-1]]])).logits[0, -1]
    assert rel_err(ours, want) <= 1e-4, rel_err(ours, want)
    assert rel_err(ours, original) > 1e-3  # the weights really are the int4 ones


def test_int4_decode_launches_as_many_kernels_as_float(decoded):
    _, quant = decoded["int4"]
    _, full = decoded["none"]
    assert len(quant) == len(full), (quant, full)
    assert sum(n.startswith("gemv_") and "w4" in n for n in quant) == 2 * 4, quant  # QKV, o, gate|up, down per layer
    assert not any(n.startswith(("reduction_", "pointwise_")) for n in quant[1:-2]), quant  # no norm / SiLU*mul launch


def test_the_4_sm_descriptor_changes_no_kernel_of_the_h200_int4_program(built, tmp_path):
    """The fixture's descriptor differs from nvidia-h200 only in its SM count (fewer interpreted programs)."""
    _, arts = built
    real = tmp_path / "h200"
    src = arts["int4"].parent / "qwen3"
    portlayer.compile(str(src), target="nvidia-h200", dtype="float32", quantize="int4", output=real, progress=False,
                      sources_only=True, verify=False)
    def launched(art: Path) -> list[str]:
        return re.findall(r"K\.(\w+)\[", (art / "host.py").read_text())

    assert launched(real) == launched(arts["int4"])
