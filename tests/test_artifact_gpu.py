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
    from portlayer.codegen import step_graphs
    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.sequence import SamplingParams

    art = portlayer.compile("tiny-qwen3", target="auto", output=tmp_path / "w", progress=False)
    warm = LLMEngine.from_artifact(art.path)
    exe = warm.executable
    at_load = [k for k in exe.step_graph_keys() if k[0] <= step_graphs.LOAD_TOKENS]
    assert exe.capture_sizes and len(exe._graphs) == len(exe.capture_sizes) + len(at_load)
    assert exe.step_sizes and exe.STEP_GRAPHS  # steps with prefill tokens replay graphs too (codegen/step_graphs.py)
    from portlayer.runtime.loaded import open_artifact

    loaded = open_artifact(art.path)
    cold = LLMEngine(loaded.executable(), loaded.graph.meta, loaded.plan)  # the constructor does not warm up
    assert not cold.executable._graphs
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[3, 4, 5], list(range(10, 40))]
    assert [o.token_ids for o in warm.generate(prompts, params)] == [o.token_ids for o in cold.generate(prompts, params)]


def test_mixed_step_from_a_step_graph_equals_the_eager_step(tmp_path: Path) -> None:
    """A step with prefill chunks and decodes replays its step graph (tokens padded to the bucket, sequences to the
    slots) and gives the eager program's logits and KV writes, within bf16's rounding (the vendor GEMM may tile
    the padded rows differently)."""
    from portlayer.codegen.host_support import kv_cache_dtype
    from portlayer.flatten.logits import feed_last_rows
    from portlayer.runtime.loaded import open_artifact
    from portlayer.runtime.validation import new_kv_cache, step_metadata

    art = portlayer.compile("tiny-qwen3", target="auto", output=tmp_path / "m", progress=False)
    loaded = open_artifact(art.path)
    exe, graph = loaded.executable(), loaded.graph
    lens, ctx = [37, 20, 1, 1, 1], [0, 16, 9, 30, 5]  # a prompt, a chunk after 16 cached tokens, three decodes
    outs = []
    for graphs in (True, False):
        exe.use_graphs = graphs
        caches = new_kv_cache(graph, len(lens), 64, 16, kv_cache_dtype(exe), exe.device)
        for c in caches:  # the cached context: the same random K/V in both runs
            g = torch.Generator(device=exe.device).manual_seed(0)
            for t in c:
                t.copy_(torch.randn(t.shape, generator=g, device=exe.device).to(t.dtype))
        md = step_metadata(lens, ctx, block_size=16, max_len=64, device=exe.device)
        md.num_prefills, md.max_query_len = 2, 37
        pos = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, lens)])
        vocab = int(graph.meta["vocab_size"])
        feeds = {"input_ids": torch.arange(sum(lens), device=exe.device) % vocab, "positions": pos.to(exe.device)}
        feed_last_rows(feeds, [v.name for v in graph.inputs], md)
        with torch.inference_mode():
            outs.append((exe.run(feeds, md, caches)[0].float(), [t.float() for c in caches for t in c]))
        if graphs:
            assert any(k[0] == "step" for k in exe._graphs), "the mixed step did not replay a step graph"
    (a, ca), (b, cb) = outs
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    for x, y in zip(ca, cb):
        torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2)
