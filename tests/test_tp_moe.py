"""Tensor parallelism of mixture-of-experts decoders on the CPU over gloo (docs/parallel.md).

The routed experts are split inside each expert (passes/shard_moe.py), latent attention by heads
(passes/shard_mla.py). References are
independent of the code under test: the op's own semantics on the whole weights (the cut),
HF ``generate`` and HF forward logits (the models), the single-rank artifact's logits.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_moe_archs import build  # the tiny MoE configs, routers initialised away from ties
from test_tp_gloo import hf_greedy

from portlayer.flatten.ir import Graph, Node, TensorType, Value
from portlayer.flatten.op_defs.attention import AttentionMetadata
from portlayer.flatten.op_defs.moe import moe_experts
from portlayer.passes.shard import ShardError
from portlayer.passes.shard_moe import expert_cut
from portlayer.passes.shard_rewrite import Rule, cut

CPU = "cpu-x86_64"
PROMPT = [5, 17, 42, 99, 3, 120, 7]  # the tiny MoE models have 128 tokens


def _experts_graph(e: int, inter: int, hidden: int, k: int, act: str = "silu") -> Graph:
    g = Graph(params={"gu": TensorType("float32", (e, 2 * inter, hidden)),
                      "dn": TensorType("float32", (e, hidden, inter))})
    g.nodes = [Node("moe", "moe_experts", ["x", "ids", "w", "gu", "dn"], [Value("y", TensorType("float32", ("T", hidden)))],
                    {"num_experts": e, "top_k": k, "intermediate_size": inter, "activation": act})]
    return g


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_expert_cut_partials_sum_to_the_whole_op(n, act):
    """5 experts (not divisible by 2, 3 or 4) of intermediate size 30 (padded at 4): the N ranks'
    partial combines add up to the op on the whole weights."""
    e, inter, hidden, k, t = 5, 30, 24, 2, 9
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(t, hidden, generator=gen)
    gu, dn = torch.randn(e, 2 * inter, hidden, generator=gen) * 0.2, torch.randn(e, hidden, inter, generator=gen) * 0.2
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen)
    whole = moe_experts(x, ids, w, gu, dn, num_experts=e, top_k=k, intermediate_size=inter, activation=act)
    g = _experts_graph(e, inter, hidden, k, act)
    parts = []
    for rank in range(n):
        ec = expert_cut(g.nodes[0], g, n, rank)
        gu_r, dn_r = cut(gu, Rule("column", 1, ec.gate_up)), cut(dn, Rule("column", 2, ec.down))
        assert gu_r.shape == (e, 2 * ec.per_rank, hidden) and dn_r.shape == (e, hidden, ec.per_rank)
        parts.append(moe_experts(x, ids, w, gu_r, dn_r, num_experts=e, top_k=k, intermediate_size=ec.per_rank,
                                 activation=act))
    torch.testing.assert_close(torch.stack(parts).sum(0), whole, atol=1e-5, rtol=1e-5)


def test_an_unknown_expert_activation_is_refused():
    g = _experts_graph(4, 8, 8, 2, act="relu6-like")
    assert "not one the op knows" in expert_cut(g.nodes[0], g, 2, 0)
    from portlayer.passes.shard import _Sharder

    with pytest.raises(ShardError, match="moe.*not one the op knows.*compile without --tensor-parallel"):
        _Sharder(g, 2, 0).experts(g.nodes[0])


@pytest.fixture(scope="module")
def moe_arts(tmp_path_factory):
    """name -> (HF model, eager; captured graph; TP-2 artifact; TP-1 artifact or None), each captured once."""
    import portlayer
    from portlayer.flatten import capture

    root = tmp_path_factory.mktemp("tp-moe")
    out = {}
    for name, single in (("qwen3-moe", True), ("deepseek-v3", False), ("glm4-moe", False)):
        model = build(name)
        g = capture(model)
        model.set_attn_implementation("eager")
        model.set_experts_implementation("eager")
        kw = dict(target=CPU, progress=False)
        tp2 = portlayer.compile(g, output=root / f"{name}-tp2", tensor_parallel=2, **kw).path
        tp1 = portlayer.compile(g, output=root / f"{name}-tp1", **kw).path if single else None
        out[name] = (model, g, tp2, tp1)
    return out


def _logits(exe, ids: list[int]) -> torch.Tensor:
    feeds = {"input_ids": torch.tensor(ids), "positions": torch.arange(len(ids)),
             "logits_indices": torch.arange(len(ids))}
    return exe.run({k: v for k, v in feeds.items() if k in exe.input_names}, AttentionMetadata.single(len(ids)),
                   None)[0]


def test_qwen3_moe_tp2_run_logits_and_chunked_preempted_batch(moe_arts, capsys, monkeypatch):
    """Qwen3-MoE at TP 2: `portlayer run` starts rank 1 itself and its 24 greedy tokens equal HF generate;
    the same group then gives the single-rank artifact's logits (<= 1e-5) and, with 8-token prefill
    chunks in 5 KV blocks of 16, three batched prompts that are preempted still equal HF generate."""
    from portlayer.cli import main
    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.kv_cache import KVCacheSpec
    from portlayer.runtime.loaded import open_artifact
    from portlayer.runtime.sequence import SamplingParams

    monkeypatch.setenv("PORTLAYER_TP_EXIT_ON_FAILURE", "0")  # the CLI's hard exit on a dead rank would end pytest
    model, _, tp2, tp1 = moe_arts["qwen3-moe"]
    graph = json.loads((tp2 / "graph.json").read_text())
    moe = [n for n in graph["nodes"] if n["op"] == "moe_experts"]
    assert moe and all(n["attrs"]["intermediate_size"] == 16 for n in moe)  # 32 per expert, half on each rank
    assert main(["run", str(tp2), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "24", "--ignore-eos",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == hf_greedy(model, PROMPT, 24)
    one = open_artifact(tp1).executable()
    eng = LLMEngine.from_artifact(tp2, block_size=16, prefill_chunk_size=8, max_batched_tokens=16,
                                  kv_cache_budget_bytes=5 * KVCacheSpec.from_meta(
                                      open_artifact(tp2).graph.meta, 16, torch.float32).bytes_per_block)
    assert type(eng.executable).__name__ == "ProxyExecutable"  # the group `run` started, reused
    for ids in (PROMPT, [127, 0, 64, 63, 1]):  # ids at both ends of each rank's vocabulary slice
        torch.testing.assert_close(_logits(eng.executable, ids), _logits(one, ids), atol=1e-5, rtol=1e-5)
    prompts = [PROMPT * 3, [9, 8, 7, 6, 5, 4], list(range(30, 50))]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert eng.stats["preemptions"] > 0
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 12) for p in prompts]
    eng.executable.close()


def test_deepseek_v3_tp2_mla_and_experts_sharded_match_hf(moe_arts):
    """DeepSeek-V3's shape (MLA, first_k_dense_replace=1, shared experts, group-limited sigmoid routing) at
    TP 2: the latent attention is split by heads (its latent cache replicated), the experts and MLPs are
    split; 16 greedy tokens equal HF generate and the logits equal HF forward."""
    from safetensors.torch import load_file

    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.sequence import SamplingParams

    model, _, tp2, _ = moe_arts["deepseek-v3"]
    graph = json.loads((tp2 / "graph.json").read_text())
    meta = graph["meta"]["tensor_parallel"]
    assert meta["replicated"] == []
    assert [n["attrs"]["num_heads"] for n in graph["nodes"] if n["op"] == "mla_attention"] == [2, 2]
    hf = model.state_dict()
    r1 = load_file(str(tp2 / "tp" / "rank1.safetensors"))
    a = "model_layers_1_self_attn_"
    torch.testing.assert_close(r1[a + "q_b_proj_weight"], hf["model.layers.1.self_attn.q_b_proj.weight"][2 * 24:])
    torch.testing.assert_close(r1[a + "kv_b_proj_weight"], hf["model.layers.1.self_attn.kv_b_proj.weight"][2 * 32:])
    torch.testing.assert_close(r1[a + "o_proj_weight"], hf["model.layers.1.self_attn.o_proj.weight"][:, 2 * 16:])
    torch.testing.assert_close(r1[a + "kv_a_proj_with_mqa_weight"],  # the latent: whole on every rank
                               hf["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"])
    assert meta["params"]["model_layers_1_mlp_experts_gate_up_proj"] == "column:1"
    assert meta["params"]["model_layers_0_mlp_down_proj_weight"] == "column:1"  # the dense first layer
    eng = LLMEngine.from_artifact(tp2)
    out = eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(model, PROMPT, 16)
    ids = [5, 17, 42, 99, 3, 120, 7, 0, 127]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(eng.executable, ids), ref, atol=1e-4, rtol=1e-4)
    eng.executable.close()


def test_glm4_moe_tp2_matches_hf(moe_arts):
    """GLM-4-MoE's shape (partial rotary, a shared expert, first_k_dense_replace=1, group-limited routing)
    at TP 2: the shared expert is column / row parallel like a dense MLP; 12 greedy tokens equal HF generate
    and the logits equal HF forward."""
    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.sequence import SamplingParams

    model, _, tp2, _ = moe_arts["glm4-moe"]
    params = json.loads((tp2 / "graph.json").read_text())["meta"]["tensor_parallel"]["params"]
    assert params["model_layers_1_mlp_shared_experts_gate_proj_weight"] == "column:0"
    assert params["model_layers_1_mlp_shared_experts_down_proj_weight"] == "column:1"
    assert params["model_layers_1_mlp_experts_down_proj"] == "column:2"
    eng = LLMEngine.from_artifact(tp2)
    out = eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(model, PROMPT, 12)
    ids = [5, 17, 42, 99, 3, 120, 7, 0, 127]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(eng.executable, ids), ref, atol=1e-4, rtol=1e-4)
    eng.executable.close()


@pytest.mark.parametrize("mix", ["softmax", "minus_mean"])
def test_mla_whose_query_mixes_heads_is_kept_whole(moe_arts, mix):
    """A query path the head tracer cannot prove head-local keeps that latent attention whole on every rank,
    with the reason, and leaves its projections uncut: a softmax across the heads before the op, or the
    subtler q - mean(q over heads), whose broadcast operand looks like a rope table but derives from heads."""
    from portlayer.passes.shard import shard_graph

    g = moe_arts["deepseek-v3"][1].copy()
    att = g.find("mla_attention")[1]
    q = att.inputs[0]
    t = g.value_types()[q]
    if mix == "softmax":
        new = [Node("q_mix", "softmax", [q], [Value("q_mix", t)], {"dim": 1, "dtype": None})]
    else:
        mean_t = TensorType(t.dtype, (t.shape[0], 1, t.shape[2]))
        new = [Node("q_mean", "mean", [q], [Value("q_mean", mean_t)], {"dims": [1], "keepdim": True, "dtype": None}),
               Node("q_mix", "sub", [q, "q_mean"], [Value("q_mix", t)], {"scalar": None, "reverse": False})]
    i = g.nodes.index(att)
    g.nodes[i:i] = new
    att.inputs[0] = "q_mix"
    out = shard_graph(g, 2, 1, {"library": "gloo"})
    meta = out.meta["tensor_parallel"]
    assert len(meta["replicated"]) == 1, meta["replicated"]
    assert ("softmax q_mix" if mix == "softmax" else "computed from the heads") in meta["replicated"][0]
    assert "model_layers_1_self_attn_q_b_proj_weight" not in meta["params"]
    assert "model_layers_1_self_attn_o_proj_weight" not in meta["params"]
    assert meta["params"]["model_layers_0_self_attn_q_b_proj_weight"] == "column:0"  # the other layer: split
    assert [n.attrs["num_heads"] for n in out.find("mla_attention")] == [2, 4]


def test_ascend_tp2_moe_validates_on_the_emulator(moe_arts, tmp_path):
    """Ascend 910B at TP 2 (float16, HCCL named, the experts as npu_grouped_matmul over each rank's
    [E, H, I/N] weights): both ranks run the CANN program on the CPU emulator of the torch_npu calls
    (gloo between them) and `validate` compares the logits with the validation set the compile computed
on the unsharded graph (the ops' reference semantics)."""
    import portlayer
    from portlayer.runtime.loaded import open_artifact

    art = portlayer.compile(moe_arts["qwen3-moe"][1], target="ascend-910b", output=tmp_path / "910b-tp2",
                            progress=False, tensor_parallel=2).path
    assert "npu_grouped_matmul" in (art / "host.py").read_text()
    loaded = open_artifact(art, emulate=True)
    exe = loaded.executable()
    assert type(exe).__name__ == "ProxyExecutable"
    report = loaded.validate(exe)
    exe.close()
    assert report.ok, report


@pytest.mark.aot
def test_triton_tp2_moe_program_lowers_and_compiles_for_sm90(moe_arts, tmp_path):
    """The sharded GEMMs, the fused MoE kernels at the per-rank intermediate size and the collectives of an
    H200 artifact (bf16, NCCL) at TP 2: collectives are host calls in place on planned buffers between
    kernels, and the kernels tensor parallelism changes compile ahead of time for sm_90. The shipped
    descriptor sends every GEMM to cuBLAS (its measured tuning); this copy asks for Triton GEMMs so that the
    sharded shapes (K = 32 for the row-parallel o_proj) are generated too."""
    import os
    import shutil
    import subprocess
    import sys

    import portlayer
    from portlayer.capabilities.descriptor import DEVICES_DIR

    desc = json.loads((DEVICES_DIR / "nvidia-h200.json").read_text())
    desc.update(name="nvidia-h200-triton-gemm", tuning={**desc.get("tuning", {}), "triton_gemm_max_tokens": 1 << 20})
    (tmp_path / "d.json").write_text(json.dumps(desc))
    art = portlayer.compile(moe_arts["qwen3-moe"][1], target=str(tmp_path / "d.json"), output=tmp_path / "h200-tp2", progress=False,
                            tensor_parallel=2).path
    host = (art / "host.py").read_text()
    assert host.count("torch.distributed.all_reduce(") >= 3 and "all_gather" in host
    assert "8 experts, top-2, 64 -> 2x16 -> 64" in host  # half of 32 per rank
    doc = json.loads((art / "kernels.json").read_text())
    # the families tensor parallelism changes; of a kernel's launch variants (the GEMM has ~20 tile configs,
    # tests/test_binaries.py builds every one of them for single-device artifacts) the first two, for test time
    kernels = {k: {**v, "variants": v.get("variants", [])[:2]} for k, v in doc["kernels"].items()
               if v["family"] in ("gemm", "gemv", "pointwise", "fused_moe")}
    assert {"gemm", "fused_moe"} <= {v["family"] for v in kernels.values()}
    sub = tmp_path / "tp-kernels"
    (sub / "kernels").mkdir(parents=True)
    for v in kernels.values():
        shutil.copyfile(art / "kernels" / f"{v['module']}.py", sub / "kernels" / f"{v['module']}.py")
    (sub / "kernels.json").write_text(json.dumps({**doc, "kernels": kernels}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, "-m", "portlayer.codegen.aot", str(sub), "--target", "sm90"],
                          capture_output=True, text=True, env=env, timeout=600)
    report = json.loads(proc.stdout or "[]")
    assert report and not [r for r in report if not r["ok"]], proc.stderr[-2000:]
    assert {r["kernel"].partition(".v")[0] for r in report} == set(kernels)  # NAME.vI: its other launch configs
