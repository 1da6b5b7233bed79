"""Artifacts built from the GraphBuilder sample (no capture: fast) for the artifact/cache/CLI tests."""

from __future__ import annotations

import json
from pathlib import Path

from ir_samples import tiny_decoder


def save_tiny_llama(d: Path, hidden: int, intermediate: int, max_positions: int, dtype=None) -> Path:
    """A seeded random 2-layer Llama (vocab 256, 4 heads / 2 KV heads) saved as an HF directory at ``d``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    (model.to(dtype) if dtype is not None else model).save_pretrained(d)
    return d


def sample_graph(seed: int = 0):
    g = tiny_decoder(seed)
    g.meta.update(task="causal_lm", vocab_size=32, max_positions=64)
    return g


def full_artifact(root: Path, monkeypatch, target: str = "cpu-x86_64") -> Path:
    """An artifact holding every file kind: a tokenizer dir and one (fake) generated source."""
    import portlayer.build as build
    from portlayer.api import ModelSource
    from portlayer.capabilities.descriptor import load_descriptor
    from portlayer.tokenizer import write_byte_tokenizer

    tok = root / "model"
    tok.mkdir(parents=True)
    write_byte_tokenizer(tok, vocab_size=32)

    def fake_codegen(result, out_dir):
        d = Path(out_dir) / "generated"
        d.mkdir()
        (d / "host_program.py").write_text("# generated host program\n")
        return [d / "host_program.py"], "cpu", "test codegen"

    monkeypatch.setattr(build, "codegen", fake_codegen)
    src = ModelSource("tiny-test", tok, "0" * 64, sample_graph())
    opts = {"dtype": None, "quantize": None}
    return build.build_artifact(src, load_descriptor(target), opts, "k" * 64, root / "art", build.Stages(False))


def rehash(art: Path) -> None:
    """Re-sign the manifest after an edit, as someone hand-editing an artifact would."""
    from portlayer.runtime.artifact import sha256_file

    mpath = art / "manifest.json"
    m = json.loads(mpath.read_text())
    for rel, info in m["files"].items():
        info["sha256"] = sha256_file(art / rel)
        info["bytes"] = (art / rel).stat().st_size
    mpath.write_text(json.dumps(m, indent=1))


def compile_in_child(cache_dir: str, delay_s: float) -> tuple[str, bool]:
    """Run in a spawned process: compile the sample with a slowed-down build (to overlap)."""
    import os
    import time

    os.environ["PORTLAYER_CACHE"] = cache_dir
    os.environ["PORTLAYER_FINGERPRINT"] = "concurrency-test"
    import portlayer
    import portlayer.build as build

    original = build.build_artifact

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return original(*args, **kwargs)

    build.build_artifact = slow
    art = portlayer.compile(sample_graph(), target="cpu-x86_64", progress=False)
    return str(art.path), art.cache_hit
