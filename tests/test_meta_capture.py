"""Capture binds a checkpoint's weights as memory maps and exports identical layers once (issue 20).

transformers builds the model on the meta device and binds each tensor by name; a tensor whose
name, dtype and shape match is the file's mapped tensor (no copy), converted ones (fused MoE
experts) are copies, buffers are recomputed by the model's own init. The references are
outside the code under test: transformers' own copying ``from_pretrained(dir)``, HF's eager
forward, the kernel's /proc/self/maps and sha256 of the checkpoint files. A model whose layers
are all the same program is exported with three layers and the third repeated; its IR must equal
the whole-model export's.
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

import pytest
import torch
import transformers as T

from portlayer.flatten import capture, interpret

capture_mod = importlib.import_module("portlayer.flatten.capture")  # the package exports the function


def _init_moe(model: torch.nn.Module) -> None:
    with torch.no_grad():  # routing away from ties, experts away from zero
        for m in model.modules():
            if getattr(m, "gate_up_proj", None) is not None and m.gate_up_proj.dim() == 3:
                torch.nn.init.normal_(m.gate_up_proj, std=0.05)
                torch.nn.init.normal_(m.down_proj, std=0.05)
            if type(m).__name__.lower().endswith("router"):
                torch.nn.init.normal_(m.weight, std=0.2)


SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, max_position_embeddings=256)
MODELS = {  # 4-5 layers: identical layers are exported once and repeated; qwen2-mixed has two layer kinds
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL, num_hidden_layers=5, num_key_value_heads=2)),
    "bert": lambda: T.BertModel(T.BertConfig(**SMALL, num_hidden_layers=4), add_pooling_layer=False),
    "qwen3-moe": lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
        **SMALL, moe_intermediate_size=32, num_hidden_layers=4, num_experts_per_tok=2, num_key_value_heads=2,
        head_dim=16, num_experts=8, norm_topk_prob=True)),
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=128, n_embd=64, n_layer=4, n_head=4, n_positions=256)),
    "qwen2-mixed": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(
        **SMALL, num_hidden_layers=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
        max_window_layers=2)),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_dirs) -> dict[str, Path]:
    out = {"tiny-qwen3": tiny_dirs["tiny-qwen3"]}  # 2 layers: the whole model is exported
    root = tmp_path_factory.mktemp("meta-capture")
    for name, make in MODELS.items():
        torch.manual_seed(0)
        model = make().eval()
        _init_moe(model)
        # sharded (the MoE): the index names the files; save_pretrained writes one tensor per expert
        model.save_pretrained(root / name, max_shard_size="150KB" if name == "qwen3-moe" else "1GB")
        out[name] = root / name
    return out


def _mapped_ranges(files: list[Path]) -> list[tuple[int, int]]:
    wanted = {str(f.resolve()) for f in files}
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] in wanted:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                assert "w" not in parts[1] or parts[1].endswith("p"), f"shared writable mapping: {line}"
                out.append((lo, hi))
    return out


def _hf_reference(d: Path) -> torch.nn.Module:
    cfg = T.AutoConfig.from_pretrained(d)
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in cfg.architectures or [])
    cls = T.AutoModelForCausalLM if causal else T.AutoModel
    return cls.from_pretrained(d, attn_implementation="eager").eval()


@pytest.mark.parametrize("name", ["llama", "tiny-qwen3", "bert", "qwen3-moe", "gpt2", "qwen2-mixed"])
def test_capture_equals_the_copying_whole_model_capture_and_hf(model_dirs, name):
    """Mapped weights and repeated layers give today's IR (transformers' copying load, every layer
    exported), the same weight values, and HF's outputs."""
    d = model_dirs[name]
    files = sorted(d.glob("*.safetensors"))
    before = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    g = capture(d)
    binding = g.meta["weights_binding"]
    assert binding["weights"] == "memory-mapped safetensors" and binding["mapped_tensors"] > 0
    repeated = g.meta.get("layers_repeated")
    if name in ("llama", "bert", "qwen3-moe", "gpt2"):  # gpt2: Conv1D weights stored transposed, tied head
        assert repeated and repeated["exported"] == 3 and repeated["layers"] == T.AutoConfig.from_pretrained(d).num_hidden_layers
    else:  # two layers, or two kinds of layer (full and sliding attention): every layer exported
        assert repeated is None

    whole = capture(capture_mod.load_hf_model(d, mapped=False), repeat_layers=False, verify=False)  # the reference IR
    assert str(g) == str(whole), "the IR differs from the copying whole-model capture's"
    assert set(g.weights) == set(whole.weights)
    ranges = _mapped_ranges(files)
    in_file = 0
    for w in g.weights:
        t = g.weights[w]
        assert not t.is_meta, w
        assert t.dtype == whole.weights[w].dtype and torch.equal(t, whole.weights[w]), w
        ptr = t.untyped_storage().data_ptr()
        in_file += any(lo <= ptr < hi for lo, hi in ranges)
    transposed = sum(w.endswith("_t") for w in g.weights)  # GPT-2's Conv1D weights, stored transposed: copies
    assert in_file >= binding["mapped_tensors"] - transposed - 1 > 0  # tied embeddings count once in the binding
    if name == "qwen3-moe":  # fused experts are made by transformers' converter: copies, 2 per layer
        assert binding["copied_tensors"] == 8

    # outputs: the graph against HF's eager forward of the model transformers loaded itself
    ref = _hf_reference(d)
    ids = torch.randint(3, 100, (11,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = ref(ids[None])
    want = (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state)[0]
    got = interpret(g, ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), float((got - want).abs().max())
    after = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    assert after == before, "the checkpoint changed under capture"


def test_moe_artifact_generates_hf_tokens(model_dirs, tmp_path):
    moe_dir = model_dirs["qwen3-moe"]
    """The compiled CPU artifact of the mapped capture: HF's greedy tokens, validation passes."""
    import portlayer

    art = portlayer.compile(moe_dir, target="cpu-x86_64", output=tmp_path / "art", progress=False)
    ref = _hf_reference(moe_dir)
    ref.set_experts_implementation("eager")
    prompt = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                            do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
    m = portlayer.load(art.path)
    assert m.validate().ok
    assert m.generate(prompt, max_tokens=6).token_ids == want
    import json

    from portlayer.runtime.artifact import MANIFEST

    said = json.loads((art.path / MANIFEST).read_text())["capture"]  # the manifest says how capture read the model
    assert said["weights_binding"]["weights"] == "memory-mapped safetensors"
    assert said["layers_repeated"]["layers"] == 4 and said["self_check"].startswith("full model")


def test_a_shard_missing_from_the_index_is_named(model_dirs, tmp_path):
    import shutil

    moe_dir = model_dirs["qwen3-moe"]
    d = tmp_path / "broken"
    shutil.copytree(moe_dir, d)
    shard = sorted(d.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(capture_mod.CaptureError, match=shard.name):
        capture(d)
