"""Cross-compiled Triton artifacts checked on this CPU: tiny Qwen3 and tiny Llama compiled for
nvidia-h200, amd-mi300x and intel-arc-a770 (float32; no quantization, int8, int4), validated under
the Triton interpreter (the generated host program and kernels, CUDA graphs off) and, unquantized,
16 greedy tokens through the paged engine equal to HF generate. One artifact also goes through the
CLI verbs `portlayer validate --interpret` and `portlayer run --interpret` in a fresh process."""

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


def _compile(tiny_dirs, tmp_path, model, target, quantize):
    import portlayer

    art = tmp_path / f"art-{model}-{target}-{quantize}"
    portlayer.compile(str(tiny_dirs[model]), target=target, output=art, dtype="float32", quantize=quantize,
                      progress=False)
    return art


@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("model", MODELS)
def test_cross_compiled_artifact_validates_under_the_interpreter(tiny_dirs, tmp_path, hf_greedy, model, target,
                                                                 quantize, monkeypatch):
    from triton_harness import use_interpreter

    from portlayer.runtime.loaded import open_artifact
    from portlayer.runtime.sequence import SamplingParams

    use_interpreter(monkeypatch)
    art = _compile(tiny_dirs, tmp_path, model, target, quantize)
    kernels = json.loads((art / "kernels.json").read_text())["kernels"]
    if quantize != "none":  # the integer weights are read by generated Triton kernels (few-rows, tiled GEMM or
        bits = 4 if quantize == "int4" else 8  # the dequantize before the vendor GEMM), never by torch.mm
        assert any(name.split("_")[0] in ("gemm", "gemv", "dequant") and f"w{bits}" in name for name in kernels), sorted(kernels)
    loaded = open_artifact(art, interpret=True)
    report = loaded.validate()
    assert report.ok, report.format_table()
    if quantize == "none":
        # 8 tokens: each interpreted decode step is seconds (the few-rows GEMM runs N/BLOCK_N programs)
        out = loaded.engine().generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
        assert list(out.token_ids) == hf_greedy[model][:8]


def test_cli_validate_and_run_interpret(tiny_dirs, tmp_path, hf_greedy):
    art = _compile(tiny_dirs, tmp_path, "tiny-qwen3", "amd-mi300x", "none")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # --interpret sets it itself, before triton is imported

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "portlayer.cli", *args], capture_output=True, text=True, env=env,
                              timeout=600)

    v = cli("validate", str(art), "--interpret")
    assert v.returncode == 0 and "PASSED" in v.stdout, v.stdout[-2000:] + v.stderr[-2000:]
    r = cli("run", str(art), "--interpret", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "16",
            "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] == hf_greedy["tiny-qwen3"]
    refused = cli("validate", str(art))  # without --interpret: the device check refuses, exit 2, no traceback
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
