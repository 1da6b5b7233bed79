"""A tiny HF Qwen3 (random weights) compiled for nvidia-h200 with --quantize int4, run under TRITON_INTERPRET=1.

Two checks of the decode step at batch 1, where the fused few-rows kernels run: its logits against HF's
forward of the same model with the artifact's int4 weights dequantized here (unpacked with torch bit ops,
q * scale + offset per group; so the quantization error itself is not counted against the kernels), and
its kernel launches, counted by wrapping the program's loaded kernels, equal to the float program's
(norm + Q|K|V, rope + KV write, attention + reduce, o-proj + residual, norm + gate|up + SiLU*up, down).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from triton_harness import record_launches, rel_err

import portlayer
from portlayer import capabilities

pytestmark = pytest.mark.interpreter
PROMPT = [5, 17, 42, 90, 3]
VOCAB = 96


def _model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    for p in model.parameters():
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF model, {quantize: artifact}) on nvidia-h200's descriptor with 4 SMs (fewer interpreted programs)."""
    from portlayer.flatten.tokenizer import write_byte_tokenizer

    root = tmp_path_factory.mktemp("quant-decode")
    d = json.loads((Path(capabilities.__file__).parent / "devices" / "nvidia-h200.json").read_text())
    d["compute_units"]["count"] = 4
    target = root / "nvidia-h200-4sm.json"
    target.write_text(json.dumps(d))
    model = _model()
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
    from portlayer.flatten.logits import feed_last_rows
    from portlayer.loaded import open_artifact
    from portlayer.runtime.validation import new_kv_cache, step_metadata

    launches: list[str] = []

    record_launches(monkeypatch, launches)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    loaded = open_artifact(art, interpret=True)
    exe, graph = loaded.executable(), loaded.graph
    names = [v.name for v in graph.inputs]
    caches = new_kv_cache(graph, 1, len(PROMPT) + 2, 16, torch.float32, "cpu")
    ids = PROMPT + [PROMPT[-1]]
    steps = [(torch.tensor(PROMPT), 0), (torch.tensor(ids[-1:]), len(PROMPT))]
    with torch.inference_mode():
        for tok, ctx in steps:
            md = step_metadata([len(tok)], [ctx], block_size=16, max_len=len(ids), device="cpu")
            feeds = {"input_ids": tok, "positions": torch.arange(ctx, ctx + len(tok))}
            feed_last_rows(feeds, names, md)
            launches.clear()
            logits = exe.run(feeds, md, caches)[0]
    return logits[-1].float(), list(launches)


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
