"""Interpreter tier: ``moe_experts`` through the lowering registry on Triton targets — the
pipeline picks triton.fused_moe, the generated host program aligns the slots by expert and
launches the two fused stages — against the op's reference (top-k 1, 2, 8; 4 to 64 experts;
ragged token counts that leave experts empty); a tiny Qwen3-MoE compiled for nvidia-h200
validates under the interpreter (`portlayer validate --interpret`), and compiled for ascend-910b
(npu_grouped_matmul, on the CPU emulator of torch_npu) generates them too."""

from __future__ import annotations

import pytest
import torch
from triton_harness import build_program, reference, rel_err, tol, use_interpreter

from portlayer.flatten.ir import GraphBuilder, TensorType

pytestmark = pytest.mark.interpreter


def _moe_graph(experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    """x, router logits -> softmax -> topk -> moe_experts (the shape HF routers capture to)."""
    gen = torch.Generator().manual_seed(seed)
    dt = str(dtype).removeprefix("torch.")
    b = GraphBuilder()
    x = b.add_input("x", TensorType(dt, ("num_tokens", hidden)))
    logits = b.add_input("logits", TensorType("float32", ("num_tokens", experts)))
    probs = b.add1("softmax", [logits], {"dim": -1})
    w, ids = b.add("topk", [probs], {"k": top_k, "dim": -1})
    gu = b.add_param("w_gate_up", (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype))
    dn = b.add_param("w_down", (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype))
    y = b.add1("moe_experts", [x, ids, w, gu, dn], {"num_experts": experts, "top_k": top_k,
                                                     "intermediate_size": inter, "activation": "silu"})
    b.graph.outputs = [y]
    return b.graph


CASES = [  # target, experts, top_k, hidden, inter, dtype, token counts run through one program
    ("nvidia-h200", 4, 1, 32, 16, torch.float32, (1, 5)),
    ("amd-mi300x", 8, 2, 32, 48, torch.float32, (3, 17)),
    ("nvidia-h200", 64, 8, 32, 16, torch.float32, (2, 9)),
    ("amd-mi300x", 16, 2, 64, 32, torch.float16, (7,)),
]


@pytest.mark.parametrize("target, experts, top_k, hidden, inter, dtype, lengths", CASES)
def test_moe_lowering_matches_reference(monkeypatch, tmp_path, target, experts, top_k, hidden, inter, dtype, lengths):
    use_interpreter(monkeypatch)
    graph = _moe_graph(experts, top_k, hidden, inter, dtype, seed=experts * 7 + top_k)
    gen, prog = build_program(graph, tmp_path, target=target)
    impls = {r["impl"] for r in prog.result.graph.meta["kernels"]}
    assert "triton.fused_moe" in impls, impls
    assert "moe_sorted" in gen.host and "fused_moe_gate_up" in gen.host  # alignment lives in the host program
    g = torch.Generator().manual_seed(1)
    for t in lengths:
        feeds = {"x": torch.randn(t, hidden, generator=g).to(dtype), "logits": torch.randn(t, experts, generator=g) * 3}
        (ours,) = prog.run(feeds, None, None)
        (want,) = reference(graph, feeds)
        assert ours.dtype == want.dtype and ours.shape == want.shape
        assert rel_err(ours, want) <= tol(dtype), (t, rel_err(ours, want))


def test_tiles_come_from_the_descriptor(tmp_path, monkeypatch):
    use_interpreter(monkeypatch)
    graph = _moe_graph(8, 2, 256, 128, torch.float32, seed=3)
    h200, _ = build_program(graph, tmp_path / "h", target="nvidia-h200")
    mi300, _ = build_program(graph, tmp_path / "m", target="amd-mi300x")
    assert "232448 B shared memory" in h200.host and "65536 B shared memory" in mi300.host
    assert "4 warps of 32" in h200.host and "2 warps of 64" in mi300.host


def _tiny_qwen3_moe():
    import transformers as T

    torch.manual_seed(0)
    cfg = T.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128)
    model = T.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "gate_up_proj", None) is not None and m.gate_up_proj.dim() == 3:
                torch.nn.init.normal_(m.gate_up_proj, std=0.05)
                torch.nn.init.normal_(m.down_proj, std=0.05)
            if type(m).__name__.lower().endswith("topkrouter"):
                torch.nn.init.normal_(m.weight, std=0.2)
    return model


PROMPT = [5, 17, 42, 99, 3, 64, 7]


def _hf_greedy(model, new: int) -> list[int]:
    model.set_experts_implementation("eager")
    model.set_attn_implementation("eager")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()


def test_tiny_qwen3_moe_for_h200_validates_under_the_interpreter(monkeypatch, tmp_path):
    import portlayer
    from portlayer.runtime.loaded import open_artifact

    use_interpreter(monkeypatch)
    model = _tiny_qwen3_moe()
    art = tmp_path / "art"
    portlayer.compile(model, target="nvidia-h200", output=art, dtype="float32", progress=False)
    assert "fused_moe_gate_up" in (art / "host.py").read_text()
    loaded = open_artifact(art, interpret=True)
    report = loaded.validate()  # prefill, packed sequences, paged prefill + decode vs the reference graph
    assert report.ok, report.format_table()


def test_tiny_qwen3_moe_on_the_ascend_emulator(tmp_path):
    """ascend-910b: the experts run as npu_grouped_matmul + npu_swiglu calls (emulated), greedy == HF."""
    import portlayer
    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.sequence import SamplingParams

    model = _tiny_qwen3_moe()
    art = tmp_path / "art"
    portlayer.compile(model, target="ascend-910b", output=art, dtype="float32", progress=False)
    assert "npu.npu_grouped_matmul(" in (art / "host.py").read_text()
    eng = LLMEngine.from_artifact(art, emulate=True)
    out = eng.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert list(out.token_ids) == _hf_greedy(model, 12)
    assert eng.executable.npu.calls["npu_grouped_matmul"] >= 2 * 12
