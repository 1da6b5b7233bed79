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


def test_load_warms_every_graph_and_first_request_equals_a_cold_engine(tmp_path: Path) -> None:
    """Loading captures every decode graph and runs one prefill (the first request pays nothing extra);
    the warm-up writes nothing a request can see: greedy tokens equal an engine that skipped it."""
    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.sequence import SamplingParams

    art = portlayer.compile("tiny-qwen3", target="auto", output=tmp_path / "w", progress=False)
    warm = LLMEngine.from_artifact(art.path)
    exe = warm.executable
    assert exe.capture_sizes and len(exe._graphs) == len(exe.capture_sizes)
    from portlayer.runtime.loaded import open_artifact

    loaded = open_artifact(art.path)
    cold = LLMEngine(loaded.executable(), loaded.graph.meta, loaded.plan)  # the constructor does not warm up
    assert not cold.executable._graphs
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[3, 4, 5], list(range(10, 40))]
    assert [o.token_ids for o in warm.generate(prompts, params)] == [o.token_ids for o in cold.generate(prompts, params)]
