"""The negotiator: one model, different devices, different and explained plans."""

from __future__ import annotations

import json

import pytest

from portlayer.capabilities.descriptor import Descriptor, load_descriptor
from portlayer.capabilities.plan import LAUNCH_FAMILIES, Plan, PlanError
from portlayer.capabilities.policy import ModelRequirements, negotiate
from portlayer.flatten.ir import Graph, Node, TensorType, Value

QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}  # fmt: skip


@pytest.fixture(scope="module")
def qwen3():
    return ModelRequirements.from_hf_config(QWEN3_06B, name="Qwen3-0.6B")


def test_requirements_from_config(qwen3):
    assert 590e6 < qwen3.param_count < 600e6  # Qwen3-0.6B: 596M with tied embeddings
    assert qwen3.kv_bytes_per_token_per_layer == 2 * 8 * 128 * 2
    assert qwen3.kv_bytes_per_token_at("float32") == 2 * 8 * 128 * 4 * 28
    assert (3072, 1024) in qwen3.gemm_shapes and qwen3.head_dims == (128,)
    assert ModelRequirements.from_json(json.loads(json.dumps(qwen3.to_json()))) == qwen3


def test_plan_differs_across_devices_as_explained(qwen3):
    plans = {t: negotiate(qwen3, t) for t in ("cpu-x86_64", "nvidia-h200", "amd-mi300x", "intel-uhd-770", "ascend-910b", "intel-arc-a770")}
    cpu, h200, mi300, igpu, ascend = (plans[k] for k in ("cpu-x86_64", "nvidia-h200", "amd-mi300x", "intel-uhd-770", "ascend-910b"))
    # dtype: fp32 on CPU, bf16 where fast, fp16 where bf16 is absent, fp16-first on Ascend
    assert cpu.compute_dtype == "float32" and "CPU" in cpu.decision("compute_dtype").reason
    assert h200.compute_dtype == "bfloat16" and mi300.compute_dtype == "bfloat16"
    assert igpu.compute_dtype == "float16" and "bf16 is absent" in igpu.decision("compute_dtype").reason
    assert ascend.compute_dtype == "float16" and "prefers" in ascend.decision("compute_dtype").reason
    # num_warps scales with the warp size: same threads, half the warps on wavefront 64
    for fam in ("pointwise", "reduction", "gemm"):
        assert h200.launch_config(fam)["num_warps"] == 2 * mi300.launch_config(fam)["num_warps"]
    assert "warp_size 64" in mi300.decision("launch.gemm").reason
    # stages from shared memory: 227 KB on H200 vs 64 KB LDS on MI300X
    assert h200.launch_config("gemm")["num_stages"] > mi300.launch_config("gemm")["num_stages"]
    # Ascend: 512-byte alignment, 128-token KV blocks, vendor ops instead of Triton
    assert ascend.buffer_alignment == 512 and "NPUCachingAllocator" in ascend.decision("buffer_alignment").reason
    assert ascend.kv_block_size == 128 and h200.kv_block_size == 16
    assert ascend.launch_config("gemm") == {} and "cann" in ascend.decision("launch.gemm").reason
    assert cpu.launch_config("pointwise") == {}
    # unified-memory iGPU: smaller KV budget than a discrete GPU of the same capacity
    a770 = plans["intel-arc-a770"]
    assert igpu.kv_cache_budget_bytes < a770.kv_cache_budget_bytes
    assert "unified with the host" in igpu.decision("kv_cache_budget_bytes").reason
    # graph capture only where the descriptor says so
    assert h200.graph_capture_sizes[:4] == [1, 2, 4, 8] and cpu.graph_capture_sizes == [] and igpu.graph_capture_sizes == []
    assert h200.prefill_chunk_size > igpu.prefill_chunk_size


def test_every_decision_has_a_reason(qwen3):
    for t in ("cpu-x86_64", "nvidia-h200", "amd-rx7900xtx", "ascend-910b", "nvidia-rtx4060-laptop"):
        plan = negotiate(qwen3, t)
        assert all(d.reason for d in plan)
        for fam in LAUNCH_FAMILIES:
            assert f"launch.{fam}" in plan.names()
        rows = plan.table()
        assert len(rows) == len(plan.decisions) and all(len(r) == 3 for r in rows)
        assert "compute_dtype" in plan.format_table()


def test_int4_where_the_device_has_fast_int4_and_decode_is_memory_bound(qwen3):
    a100 = negotiate(qwen3, "nvidia-a100-80gb")
    assert a100.weight_quantization == "int4" and "memory-bound" in a100.decision("weight_quantization").reason
    assert negotiate(qwen3, "nvidia-h200").weight_quantization == "none"  # Hopper lists no int4


def test_edited_descriptor_changes_the_plan_without_code(qwen3, tmp_path):
    raw = load_descriptor("nvidia-h200").raw
    raw["memory"]["bandwidth_gbps"] = 500  # a user's edited copy: far less bandwidth
    raw["compute_units"]["max_shared_memory_per_block_bytes"] = 65536
    path = tmp_path / "my-h200.json"
    path.write_text(json.dumps(raw))
    base, edited = negotiate(qwen3, "nvidia-h200"), negotiate(qwen3, str(path))
    assert edited.target_sha256 != base.target_sha256
    assert edited.prefill_chunk_size > base.prefill_chunk_size  # ridge moved: compute-bound later
    assert "500 GB/s" in edited.decision("prefill_chunk_size").reason
    assert edited.launch_config("gemm")["num_stages"] < base.launch_config("gemm")["num_stages"]


def test_measured_prefill_tile_is_the_descriptors_data(qwen3, tmp_path):
    """tuning.attention_prefill_block_m (a measurement, with its source) sets the prefill attention tile and
    its warps; removing it from an edited copy falls back to the shared-memory rule, no code involved."""
    raw = load_descriptor("nvidia-h200").raw
    measured = negotiate(qwen3, "nvidia-h200")
    cfg = measured.launch_config("attention_prefill")
    assert cfg["BLOCK_M"] == raw["tuning"]["attention_prefill_block_m"] == 64 and cfg["num_warps"] == 4
    assert "measured" in measured.decision("launch.attention_prefill").reason
    del raw["tuning"]["attention_prefill_block_m"]
    del raw["sources"]["tuning.attention_prefill_block_m"]
    path = tmp_path / "h200-unmeasured.json"
    path.write_text(json.dumps(raw))
    rule = negotiate(qwen3, str(path)).launch_config("attention_prefill")
    assert rule["BLOCK_M"] == 128 and rule["num_warps"] == 8  # 232 KB of shared memory holds two 128-row stages


def test_deterministic_and_json_round_trip(qwen3):
    a, b = negotiate(qwen3, "amd-mi300x"), negotiate(qwen3, "amd-mi300x")
    assert a.to_json() == b.to_json()
    text = json.dumps(a.to_json())
    back = Plan.from_json(json.loads(text))
    assert back.decisions == a.decisions and back.compute_dtype == "bfloat16"
    assert back.launch_configs == a.launch_configs


def test_user_overrides_renegotiate(qwen3):
    plan = negotiate(qwen3, "nvidia-h200")
    forced = plan.with_overrides(compute_dtype="float32")
    d = forced.decision("compute_dtype")
    assert d.value == "float32" and d.reason.startswith("user override")
    # dependent decisions follow: fp32 KV costs twice the bytes per token
    assert forced.value("max_kv_tokens") < plan.value("max_kv_tokens")
    assert forced.launch_config("pointwise")["BLOCK"] == plan.launch_config("pointwise")["BLOCK"] // 2
    q = forced.with_overrides(weight_quantization="int8")
    assert q.compute_dtype == "float32" and q.weight_quantization == "int8"
    with pytest.raises(KeyError):
        plan.with_overrides(num_warps=3)
    with pytest.raises(PlanError):
        negotiate(qwen3, "nvidia-h200", {"compute_dtype": "float64"})


def test_model_too_large_quantizes_or_fails():
    big = ModelRequirements.from_hf_config({**QWEN3_06B, "hidden_size": 8192, "intermediate_size": 28672,
                                            "num_hidden_layers": 80, "num_attention_heads": 64, "head_dim": 128}, name="70B")  # fmt: skip
    plan = negotiate(big, "nvidia-h200")  # 140 GB in bf16 > 0.9 * 141 GB
    assert plan.weight_quantization == "int8" and "exceed" in plan.decision("weight_quantization").reason
    with pytest.raises(PlanError, match="even at int4"):
        negotiate(big, "nvidia-rtx4060-laptop")


def _tiny_graph() -> Graph:
    x = Value("x", TensorType("float32", ("num_tokens", 64)))
    g = Graph(inputs=[x])
    g.params = {"w_q": TensorType("float32", (64, 64)), "w_up": TensorType("float32", (128, 64))}
    g.nodes = [
        Node("q", "linear", ["x", "w_q", None], [Value("q", TensorType("float32", ("num_tokens", 64)))]),
        Node("attn", "attention", ["q", "q", "q"], [Value("attn", TensorType("float32", ("num_tokens", 64)))],
             attrs={"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "causal": True, "sliding_window": None}),  # fmt: skip
        Node("up", "linear", ["attn", "w_up", None], [Value("up", TensorType("float32", ("num_tokens", 128)))]),
    ]
    g.outputs = ["up"]
    g.meta = {"task": "causal_lm", "dtype": "float32", "num_layers": 1, "hidden_size": 64, "max_positions": 256,
              "intermediate_size": 128, "vocab_size": 100, "model_type": "toy"}  # fmt: skip
    return g


@pytest.mark.filterwarnings("ignore:graph_cost failed")
def test_requirements_from_a_hand_built_graph():
    r = ModelRequirements.from_graph(_tiny_graph())
    assert r.param_count == 64 * 64 + 128 * 64 and r.param_bytes == 4 * r.param_count
    assert set(r.gemm_shapes) == {(64, 64), (128, 64)}
    assert r.head_dims == (16,) and r.num_kv_heads == 2
    assert r.kv_bytes_per_token_per_layer == 2 * 2 * 16 * 4
    assert r.flops_per_token >= 2 * r.param_count
    plan = negotiate(r, "nvidia-h200")
    assert plan.prefill_chunk_size == 256  # capped by max_positions 256


def test_requirements_from_a_captured_tiny_qwen3():
    capture_mod = pytest.importorskip("portlayer.flatten.capture")
    import torch
    import transformers

    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    graph = capture_mod.capture(model)
    r = ModelRequirements.from_graph(graph, name="tiny-qwen3")
    # every stored tensor counts: the module's parameters plus constants such as the rope cache
    assert r.param_count == sum(t.numel() for t in graph.params.values()) >= sum(p.numel() for p in model.parameters())
    assert r.head_dims == (16,) and r.num_kv_heads == 2 and r.num_layers == 2
    assert (128, 64) in r.gemm_shapes  # gate/up projections [out=128, in=64]
    ref = ModelRequirements.from_hf_config(cfg.to_dict(), name="tiny-qwen3", dtype=r.dtype)
    assert r.kv_bytes_per_token_per_layer == ref.kv_bytes_per_token_per_layer
    plans = {t: negotiate(r, t) for t in ("cpu-x86_64", "ascend-910b")}
    assert plans["ascend-910b"].kv_block_size == 128 and plans["cpu-x86_64"].compute_dtype == "float32"


def test_descriptor_object_accepted(qwen3):
    d = Descriptor.from_dict(load_descriptor("intel-arc-a770").raw, origin="test")
    assert negotiate(qwen3, d).target == "intel-arc-a770"


def test_explain_cli(capsys):
    from pathlib import Path

    from portlayer.cli_capabilities import main

    model = str(Path(__file__).parent / "fixtures" / "qwen3-0.6b")
    assert main(["explain", model, "--target", "ascend-910b"]) == 0
    out = capsys.readouterr().out
    assert "kv_block_size" in out and "128" in out and "NPUCachingAllocator" in out
    assert main(["explain", model, "--target", "nvidia-h200", "--dtype", "float32", "--json"]) == 0
    plan = Plan.from_json(json.loads(capsys.readouterr().out))
    assert plan.compute_dtype == "float32" and plan.decision("compute_dtype").reason.startswith("user override")


def test_step_graph_buckets_only_for_a_kv_cached_model_on_one_triton_device(qwen3):
    h200 = negotiate(qwen3, "nvidia-h200")
    buckets = h200.step_graph_tokens
    assert buckets[:4] == [16, 32, 64, 128] and buckets[-1] == h200.max_batched_tokens
    assert all(b - a == 256 for a, b in zip(buckets[4:], buckets[5:]))
    assert negotiate(qwen3, "cpu-x86_64").step_graph_tokens == []  # no graphs
    assert "cann" in negotiate(qwen3, "ascend-910b").decision("step_graph_tokens").reason  # graphs, not Triton
    two = negotiate(qwen3, "nvidia-h200", {"tensor_parallel": 2})
    assert two.step_graph_tokens == [] and "tensor parallel" in two.decision("step_graph_tokens").reason
    bert = ModelRequirements.from_hf_config({"architectures": ["BertModel"], "hidden_size": 64, "intermediate_size": 128,
                                             "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128,
                                             "max_position_embeddings": 128}, name="bert")
    plan = negotiate(bert, "nvidia-h200")
    assert plan.step_graph_tokens == [] and "KV cache" in plan.decision("step_graph_tokens").reason
