"""Interpreter tier, whole model: the generated tiny-Qwen3 program (Triton kernels under
TRITON_INTERPRET=1, Plan launch configs) matches the reference executable on a packed
prefill with a paged cache, the decode step after it, and cache-less dense attention."""

from __future__ import annotations

import pytest
import torch
from triton_harness import build_program, rel_err, use_interpreter

pytestmark = pytest.mark.interpreter


@pytest.fixture(autouse=True)
def _interp(monkeypatch):
    use_interpreter(monkeypatch)


def _program(graph, tmp_path, descriptor: str, **plan_overrides):
    from portlayer.backends.generate import generate
    from portlayer.codegen.program import load_program, write_program
    from portlayer.passes.pipeline import run_pipeline

    r = run_pipeline(graph, descriptor, overrides=plan_overrides or None)
    gen = generate(r.graph, r.plan, r.descriptor)
    assert gen.fallbacks == []
    write_program(gen, tmp_path)
    return load_program(tmp_path, r.graph.weights, "cpu", max_seqs=4)


@pytest.mark.parametrize("descriptor", ["nvidia-h200", "amd-mi300x"])
def test_tiny_qwen3_paged_prefill_then_decode(captured, tmp_path, descriptor):
    from portlayer.flatten.op_defs.attention import AttentionMetadata
    from portlayer.runtime.executable import ReferenceExecutable

    graph = captured["tiny-qwen3"]
    prog = _program(graph, tmp_path, descriptor, compute_dtype="float32", weight_quantization="none")
    ref = ReferenceExecutable(graph)
    torch.manual_seed(1)
    mine = [(torch.zeros(8, 16, 2, 16), torch.zeros(8, 16, 2, 16)) for _ in range(2)]
    theirs = [(a.clone(), b.clone()) for a, b in mine]
    meta = AttentionMetadata(torch.tensor([0, 5, 8], dtype=torch.int32), torch.tensor([5, 3], dtype=torch.int32),
                             torch.tensor([32, 33, 34, 35, 36, 80, 81, 82]),
                             torch.tensor([[2, 4], [5, 6]], dtype=torch.int32), 2, 5, 5)
    feeds = {"input_ids": torch.randint(0, 256, (8,)), "positions": torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])}
    assert rel_err(prog.run(feeds, meta, mine)[0], ref.run(feeds, meta, theirs)[0]) < 1e-4
    meta = AttentionMetadata(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([6, 4], dtype=torch.int32),
                             torch.tensor([37, 83]), torch.tensor([[2, 4], [5, 6]], dtype=torch.int32), 0, 1, 6)
    feeds = {"input_ids": torch.randint(0, 256, (2,)), "positions": torch.tensor([5, 3])}
    assert rel_err(prog.run(feeds, meta, mine)[0], ref.run(feeds, meta, theirs)[0]) < 1e-4


def test_tiny_qwen3_dense_without_cache(captured, tmp_path):
    from portlayer.runtime.executable import ReferenceExecutable

    graph = captured["tiny-qwen3"]
    prog = _program(graph, tmp_path, "nvidia-a100-80gb", compute_dtype="float32", weight_quantization="none")
    feeds = {"input_ids": torch.randint(0, 256, (6,)), "positions": torch.arange(6)}
    assert rel_err(prog.run(feeds, None, None)[0], ReferenceExecutable(graph).run(feeds, None, None)[0]) < 1e-4


def test_program_from_the_pass_pipeline(captured, tmp_path):
    """The fuse pass's groups (q/k-norm+rope, GEMM+reshape, attention+reshape, GEMM epilogues)
    are realised without reference fallbacks and match the reference executable, paged."""
    from portlayer.backends.generate import generate
    from portlayer.codegen.program import load_program, write_program
    from portlayer.flatten.op_defs.attention import AttentionMetadata
    from portlayer.passes.pipeline import run_pipeline
    from portlayer.runtime.executable import ReferenceExecutable

    graph = captured["tiny-qwen3"]
    result = run_pipeline(graph, "nvidia-h200", overrides={"compute_dtype": "float32"})
    gen = generate(result.graph, result.plan, result.descriptor)
    assert gen.fallbacks == []
    write_program(gen, tmp_path)
    prog = load_program(tmp_path, result.graph.weights, "cpu", max_seqs=4)
    mine = [(torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16)) for _ in range(2)]
    theirs = [(a.clone(), b.clone()) for a, b in mine]
    meta = AttentionMetadata(torch.tensor([0, 6, 7], dtype=torch.int32), torch.tensor([6, 1], dtype=torch.int32),
                             torch.tensor([48, 49, 50, 51, 52, 53, 16]), torch.tensor([[3], [1]], dtype=torch.int32),
                             1, 6, 6)
    feeds = {"input_ids": torch.randint(0, 256, (7,)), "positions": torch.tensor([0, 1, 2, 3, 4, 5, 0])}
    assert rel_err(prog.run(feeds, meta, mine)[0], ReferenceExecutable(graph).run(feeds, meta, theirs)[0]) < 1e-4


@pytest.mark.parametrize("triton_gemm", [False, True])
def test_sampled_logit_rows(captured, tmp_path, triton_gemm):
    """With select_logit_rows (logits only for the rows the sampler reads, [num_seqs, vocab]),
    the program still matches the reference; the lm_head GEMM runs over num_seqs rows."""
    from portlayer.flatten.logits import select_logit_rows
    from portlayer.flatten.op_defs.attention import AttentionMetadata
    from portlayer.runtime.executable import ReferenceExecutable

    graph = select_logit_rows(captured["tiny-qwen3"])
    _, prog = build_program(graph, tmp_path, triton_gemm_max_tokens=(1 << 30) if triton_gemm else 0)
    meta = AttentionMetadata.from_lens([4, 3])
    feeds = {"input_ids": torch.randint(0, 256, (7,)), "positions": torch.tensor([0, 1, 2, 3, 0, 1, 2]),
             "logits_indices": torch.tensor([3, 6])}
    feeds = {v.name: feeds[v.name] for v in graph.inputs}
    ours = prog.run(feeds, meta, None)[0]
    want = ReferenceExecutable(graph).run(feeds, meta, None)[0]
    assert ours.shape == want.shape and rel_err(ours, want) < 1e-4
