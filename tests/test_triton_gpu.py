"""GPU tier (an NVIDIA GPU; measured on an H200, see docs/gpu.md): generated programs vs HF
eager on the same GPU. Runs benchmarks/gpu_check.py in its own process, because the
interpreter tier may have put Triton into interpreter mode in this one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.version.hip is None),
                       reason="needs an NVIDIA GPU: torch.cuda.is_available() is False here"),
]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(out)], env=env,
                   check=True, timeout=1200)
    return json.loads((out / "gpu_check.json").read_text())


def test_tiny_qwen3_fp32_greedy_tokens_match_hf(results):
    assert results["tiny"]["match"], results["tiny"]


def test_qwen3_06b_bf16_logits_within_hf_spread(results):
    r = results["qwen3_06b"]
    # Our distance to HF fp32 may not exceed 1.5x the distance HF bf16 itself has.
    assert r["worst_ratio_prefill"] <= 1.5 and r["worst_ratio_decode"] <= 1.5, r
    assert all(row["graph_vs_eager"] < 1e-3 for row in r["decode"])  # CUDA-graph replay == eager launch
    assert r["graphs_captured"] >= 1
