"""Cross-compiled Triton artifacts checked on this CPU: tiny Qwen3 and tiny Llama compiled for
nvidia-h200, amd-mi300x and intel-arc-a770 (float32; no quantization, int8, int4) through
`portlayer compile`, then `portlayer validate ART --interpret` (the generated host program and
kernels, run by the Triton interpreter) and, unquantized, 16 greedy tokens through
`portlayer run --interpret` equal to HF generate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.interpreter
TARGETS = ["nvidia-h200", "amd-mi300x", "intel-arc-a770"]
MODELS = ["tiny-qwen3", "tiny-llama"]
PROMPT = [5, 17, 42, 99, 3]


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # --interpret sets it itself, before triton is imported
    return subprocess.run([sys.executable, "-m", "portlayer.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.fixture(scope="module")
def hf_greedy(tiny_dirs):
    from conftest import hf_model

    out = {}
    for name in MODELS:
        model = hf_model(tiny_dirs[name])
        ids = torch.tensor([PROMPT])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                             do_sample=False)
        out[name] = gen[0, len(PROMPT):].tolist()
    return out


@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("model", MODELS)
def test_cross_compiled_artifact_validates_under_the_interpreter(tiny_dirs, tmp_path, hf_greedy, model, target,
                                                                 quantize):
    art = tmp_path / "art"
    done = _cli("compile", str(tiny_dirs[model]), "--target", target, "--dtype", "float32", "--quantize", quantize,
                "-o", str(art), "--no-progress")
    assert done.returncode == 0, done.stderr[-2000:]
    kernels = json.loads((art / "kernels.json").read_text())["kernels"]
    if quantize != "none":
        assert any(name.startswith(f"gemm_w{4 if quantize == 'int4' else 8}") for name in kernels), sorted(kernels)
    v = _cli("validate", str(art), "--interpret")
    assert v.returncode == 0 and "PASSED" in v.stdout, v.stdout[-2000:] + v.stderr[-2000:]
    if quantize == "none":
        r = _cli("run", str(art), "--interpret", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "16",
                 "--ignore-eos", "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] == hf_greedy[model]
