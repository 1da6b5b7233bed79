"""Tensor parallelism on the CPU over gloo (docs/parallel.md): real process groups, real ranks.

References are independent of the code under test: HF ``generate`` (greedy) and HF weights for
the shard layout, the single-rank artifact's logits for the sharded program. The pytest process
is rank 0 (its engine drives a proxy executable); the other ranks are spawned processes. One
group per artifact is started and reused by the tests that follow it, since starting ranks is
the expensive part.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from conftest import hf_model

from portlayer.flatten.op_defs.attention import AttentionMetadata

PROMPT = [5, 17, 42, 99, 3, 250, 7]
CPU = "cpu-x86_64"


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    t = torch.tensor([ids])
    out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def arts(tiny_dirs, tmp_path_factory):
    import portlayer

    root = tmp_path_factory.mktemp("tp-arts")
    out = {}
    for name, n in (("tiny-llama", 2), ("tiny-qwen3", 4)):
        out[name, n] = portlayer.compile(tiny_dirs[name], target=CPU, output=root / f"{name}-tp{n}", progress=False,
                                         tensor_parallel=n).path
        out[name, 1] = portlayer.compile(tiny_dirs[name], target=CPU, output=root / f"{name}-tp1", progress=False).path
    return out


def test_shard_layout_follows_the_hf_weights(arts, tiny_dirs):
    """Rank 1's shard of tiny-llama (TP 2) holds exactly the rows/columns Megatron's layout gives it,
    read from the HF model; tiny-qwen3 at TP 4 replicates its 2 KV heads (ranks 0,1 -> head 0)."""
    from safetensors.torch import load_file

    hf = hf_model(tiny_dirs["tiny-llama"]).state_dict()
    r1 = load_file(str(arts["tiny-llama", 2] / "tp" / "rank1.safetensors"))
    L = "model_layers_0_"
    torch.testing.assert_close(r1[L + "self_attn_q_proj_weight"], hf["model.layers.0.self_attn.q_proj.weight"][32:])
    torch.testing.assert_close(r1[L + "self_attn_k_proj_weight"], hf["model.layers.0.self_attn.k_proj.weight"][16:])
    torch.testing.assert_close(r1[L + "self_attn_o_proj_weight"], hf["model.layers.0.self_attn.o_proj.weight"][:, 32:])
    torch.testing.assert_close(r1[L + "mlp_up_proj_weight"], hf["model.layers.0.mlp.up_proj.weight"][64:])
    torch.testing.assert_close(r1[L + "mlp_down_proj_weight"], hf["model.layers.0.mlp.down_proj.weight"][:, 64:])
    torch.testing.assert_close(r1["model_embed_tokens_weight"], hf["model.embed_tokens.weight"][128:])
    torch.testing.assert_close(r1["lm_head_weight"], hf["lm_head.weight"][128:])
    torch.testing.assert_close(r1[L + "input_layernorm_weight"], hf["model.layers.0.input_layernorm.weight"])
    graph = json.loads((arts["tiny-llama", 2] / "graph.json").read_text())
    ops = [n["op"] for n in graph["nodes"]]
    assert ops.count("all_reduce") == 2 * 2 + 1 and ops.count("all_gather") == 1  # o/down per layer + embedding
    plan = {d["name"]: d["value"] for d in json.loads((arts["tiny-llama", 2] / "plan.json").read_text())["decisions"]}
    assert plan["tensor_parallel"] == 2
    q = hf_model(tiny_dirs["tiny-qwen3"]).state_dict()
    k = q["model.layers.1.self_attn.k_proj.weight"]  # [2 heads * 16, 64]
    for rank, head in ((1, 0), (2, 1), (3, 1)):
        rk = load_file(str(arts["tiny-qwen3", 4] / "tp" / f"rank{rank}.safetensors"))
        torch.testing.assert_close(rk["model_layers_1_self_attn_k_proj_weight"], k[16 * head:16 * (head + 1)])
        torch.testing.assert_close(rk["model_layers_1_self_attn_q_proj_weight"],
                                   q["model.layers.1.self_attn.q_proj.weight"][16 * rank:16 * (rank + 1)])


def test_tp2_run_matches_hf_generate(arts, tiny_dirs, capsys, monkeypatch):
    """`portlayer run` on the TP-2 artifact starts rank 1 itself; 24 greedy tokens equal HF generate."""
    from portlayer.cli import main

    monkeypatch.setenv("PORTLAYER_TP_EXIT_ON_FAILURE", "0")  # the CLI's hard exit on a dead rank would end pytest

    ids = ",".join(map(str, PROMPT))
    assert main(["run", str(arts["tiny-llama", 2]), "--prompt-ids", ids, "--max-tokens", "24", "--ignore-eos",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == hf_greedy(hf_model(tiny_dirs["tiny-llama"]), PROMPT, 24)


def _exe(path):
    from portlayer.runtime.loaded import open_artifact

    return open_artifact(path).executable()


def _logits(exe, ids: list[int]) -> torch.Tensor:
    feeds = {"input_ids": torch.tensor(ids), "positions": torch.arange(len(ids)),
             "logits_indices": torch.arange(len(ids))}
    return exe.run({k: v for k, v in feeds.items() if k in exe.input_names}, AttentionMetadata.single(len(ids)),
                   None)[0]


def test_tp2_logits_match_the_single_rank_artifact(arts):
    tp, one = _exe(arts["tiny-llama", 2]), _exe(arts["tiny-llama", 1])
    assert type(tp).__name__ == "ProxyExecutable"
    for ids in (PROMPT, [255, 0, 128, 127, 1]):  # ids at both ends of each rank's vocab slice
        torch.testing.assert_close(_logits(tp, ids), _logits(one, ids), atol=1e-5, rtol=1e-5)


def test_tp2_chunked_prefill_and_preemption_match_hf(arts, tiny_dirs):
    """Three prompts in 4 KV blocks of 16 with 8-token prefill chunks: preemption by recompute and
    chunked prefill on every rank in lock step; each output still equals HF generate."""
    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.sequence import SamplingParams

    prompts = [PROMPT * 3, [9, 8, 7, 6, 5, 4], list(range(30, 50))]
    eng = LLMEngine.from_artifact(arts["tiny-llama", 2], block_size=16, prefill_chunk_size=8, max_batched_tokens=16,
                                  kv_cache_budget_bytes=4 * 2 * 16 * 1 * (16 + 16) * 4)  # 4 blocks: layers x block x KV heads per rank x (K+V dims) x fp32
    assert eng.config.num_blocks == 4
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert eng.stats["preemptions"] > 0  # 3 + 2 + 2 blocks wanted, 4 held
    model = hf_model(tiny_dirs["tiny-llama"])
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(model, p, 12), f"prompt of {len(p)} tokens"


def test_tp2_serve_completion_equals_single_rank(arts):
    """`serve` at TP 2 (the running group behind the OpenAI-compatible server, the openai client): a greedy
    completion equals the same request served by the single-rank artifact."""
    from serve_samples import client, serving

    from portlayer.runtime.engine import LLMEngine

    texts = []
    for n in (2, 1):
        eng = LLMEngine.from_artifact(arts["tiny-llama", n])
        assert (type(eng.executable).__name__ == "ProxyExecutable") == (n == 2)
        with serving(eng) as srv:
            r = client(srv).completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 24
        texts.append(r.choices[0].text)
    assert texts[0] == texts[1] and texts[0]


def test_a_dead_rank_fails_the_group_within_10s(arts, monkeypatch):
    """Rank 1 is killed in the middle of `portlayer run`: the command stops with the error naming it, in < 10 s.
    (In a process of its own the CLI prints that line and exits 1 at once; here it raises, so pytest lives.)"""
    from portlayer.cli import main
    from portlayer.runtime.parallel.group import TensorParallelGroupError

    monkeypatch.setenv("PORTLAYER_TP_EXIT_ON_FAILURE", "0")
    proxy = _exe(arts["tiny-llama", 2])  # the group the tests above use; `run` reuses it
    worker = proxy.watchdog.procs[0]
    killed: list[float] = []

    def kill() -> None:
        time.sleep(1.0)
        killed.append(time.monotonic())
        worker.kill()

    threading.Thread(target=kill, daemon=True).start()
    with pytest.raises(TensorParallelGroupError, match="rank 1 .* exited with code -9") as e:
        main(["run", str(arts["tiny-llama", 2]), "--prompt-ids", "5,17,42", "--max-tokens", "100000", "--ignore-eos"])
    assert killed and time.monotonic() - killed[0] < 10
    assert "tensor-parallel group failed" in str(e.value)
    proxy.close()


def test_tp4_qwen3_replicated_kv_heads_match_hf_and_single_rank(arts, tiny_dirs):
    """tiny-qwen3 has 2 KV heads: at TP 4 each is replicated on two ranks (4 processes)."""
    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.sequence import SamplingParams

    eng = LLMEngine.from_artifact(arts["tiny-qwen3", 4])
    out = eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf_model(tiny_dirs["tiny-qwen3"]), PROMPT, 24)
    torch.testing.assert_close(_logits(eng.executable, PROMPT), _logits(_exe(arts["tiny-qwen3", 1]), PROMPT),
                               atol=1e-5, rtol=1e-5)
    eng.executable.close()
