"""On a real GPU: an artifact compiled for this device loads on cuda:0 and validates (skipped elsewhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from artifact_samples import sample_graph

import portlayer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]


def test_compile_auto_targets_the_gpu_and_validates(tmp_path: Path) -> None:
    art = portlayer.compile(sample_graph(), target="auto", output=tmp_path / "a", progress=False)
    m = art.manifest
    assert m.target["device_type"] == "cuda" and m.target["codegen"] == "triton", m.target
    loaded = art.load()
    assert loaded.device.torch_device.startswith("cuda")
    report = loaded.validate()
    assert report.device.startswith("cuda"), report.device
    assert report.ok, report.format_table()


def test_tiny_qwen3_validates_on_gpu(tmp_path: Path) -> None:
    loaded = portlayer.compile("tiny-qwen3", target="auto", output=tmp_path / "q", progress=False).load()
    report = loaded.validate()
    assert report.ok, report.format_table()
    out = loaded.generate([1, 2, 3], max_tokens=4)
    assert len(out.token_ids) == 4
