"""`portlayer explain` states the memory that compiling and serving need, and refuses early (issue 20)."""

from __future__ import annotations

import re
from pathlib import Path

from portlayer.cli import main


def _stored_gib(d: Path) -> float:
    return sum(p.stat().st_size for p in d.glob("*.safetensors")) / (1 << 30)


def test_explain_prints_memory_needs_from_the_files(tiny_dirs, capsys):
    d = tiny_dirs["tiny-llama"]
    assert main(["explain", str(d), "--target", "nvidia-h200", "--host-memory", "64"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"memory needs \(weights as stored: ([0-9.]+) GiB\)", out)
    assert m, out[-800:]
    assert abs(float(m.group(1)) - _stored_gib(d)) < 0.006
    for row in ("compile, host", "serve, host", "serve, device"):
        assert row in out
    compile_gib = float(re.search(r"compile, host\s+([0-9.]+) GiB", out).group(1))
    assert compile_gib >= _stored_gib(d)  # holds the weights at least once


def test_explain_refuses_a_machine_too_small_before_loading(tiny_dirs, capsys, monkeypatch):
    import importlib

    capture_mod = importlib.import_module("portlayer.flatten.capture")  # the module (the package exports the function)

    def no_load(*_a, **_k):
        raise AssertionError("explain loaded the model before refusing")

    monkeypatch.setattr(capture_mod, "load_hf_model", no_load)
    rc = main(["explain", str(tiny_dirs["tiny-llama"]), "--target", "cpu-x86_64", "--host-memory", "0.01"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "compiling needs" in err and "--host-memory is 0.01 GiB" in err and "Traceback" not in err


def test_explain_refuses_compiling_an_8b_config_on_16_gib(tmp_path, capsys):
    """A config-only model (no weights on disk): the needs come from the parameter count."""
    import json

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
           "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    params = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096 + 2 * 4096) + 2 * 128256 * 4096 + 4096
    rc = main(["explain", str(tmp_path), "--target", "nvidia-h200", "--host-memory", "16"])
    captured = capsys.readouterr()
    stored = float(re.search(r"weights as stored: ([0-9.]+) GiB", captured.out).group(1))
    assert abs(stored - params * 2 / (1 << 30)) < 0.01  # bf16, Llama-3-8B's 8.03 B parameters
    assert rc == 2 and "compiling needs" in captured.err and "--host-memory is 16.00 GiB" in captured.err
    needed = float(re.search(r"needs ([0-9.]+) GiB of host memory", captured.err).group(1))
    assert needed > stored
    assert main(["explain", str(tmp_path), "--target", "nvidia-h200", "--host-memory", "128"]) == 0
