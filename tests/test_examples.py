"""The examples and the embedded demo run end to end, offline (each in its own process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(args: list[str], tmp_path: Path) -> str:
    # pinned fingerprint: others editing the shared checkout between two runs must not turn a hit into a miss
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PORTLAYER_FINGERPRINT": "examples-test"}
    p = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    return p.stdout


def test_demo_embeds_and_generates(tmp_path: Path) -> None:
    out = _run(["-m", "portlayer.demo", "--no-progress"], tmp_path)
    assert "cosine similarity" in out and "validation on cpu: PASSED" in out
    lines = [ln for ln in out.splitlines() if "guitar" in ln]
    sims = [float(x) for x in lines[0].split()[-4:]]
    assert sims[0] > 0.99 and sims[1] > sims[2] + 0.3, lines  # paraphrases are closer than unrelated text
    answer = [ln for ln in out.splitlines() if ln.strip().startswith("A:")]
    assert answer and "Paris" in answer[0], out  # SmolLM2-135M-Instruct through its chat template
    again = _run(["-m", "portlayer.demo", "--no-progress"], tmp_path)
    assert again.count("cache hit") == 2, again


def test_minilm_embeddings_example(tmp_path: Path) -> None:
    out = _run([str(ROOT / "examples" / "minilm_embeddings.py")], tmp_path)
    ranked = [ln for ln in out.splitlines() if ln.startswith("  ") and "." in ln]
    assert "bake" in ranked[0] or "sourdough" in ranked[0], out


def test_generate_tiny_qwen3_example(tmp_path: Path) -> None:
    out = _run([str(ROOT / "examples" / "generate_tiny_qwen3.py"), "--tokens", "3"], tmp_path)
    assert out.count("(length)") == 3


def test_compile_for_every_target_example(tmp_path: Path) -> None:
    from portlayer.capabilities.descriptor import list_descriptors

    out = _run([str(ROOT / "examples" / "compile_for_every_target.py"), "-o", str(tmp_path / "t")], tmp_path)
    for name in list_descriptors():
        assert (tmp_path / "t" / name / "manifest.json").is_file()
    assert "compute_dtype" in out and "kv_block_size" in out  # decisions that differ are listed
