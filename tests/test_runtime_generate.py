"""The engine against HF ``generate``: continuous batching, staggered arrival, preemption,
prefix caching, chunked prefill and rejection, on tiny Llama and tiny Qwen3 (CPU, fp32).

Every expected token comes from HF eager ``generate`` on the same weights, one prompt at a
time, with EOS disabled; the engine must match it token for token.
"""

from __future__ import annotations

import pytest
import torch

from portlayer.runtime.engine import LLMEngine
from portlayer.runtime.kv_cache import KVCacheSpec
from portlayer.runtime.sequence import RequestRejected, SamplingParams

MODELS = ["tiny-llama", "tiny-qwen3"]
LENGTHS = [1, 7, 33, 64, 100, 129, 180, 200]
NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in LENGTHS]


def _prefix_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 256, (64,), generator=g).tolist()
    return [prefix + torch.randint(3, 256, (n,), generator=g).tolist() for n in (21, 40)]


def hf_generate(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def setups(tiny_dirs):
    """Per model: the captured graph and HF's tokens for every prompt used below."""
    from conftest import hf_model

    from portlayer.flatten import capture

    out = {}
    for name in MODELS:
        hf = hf_model(tiny_dirs[name])
        ref = {tuple(p): hf_generate(hf, p) for p in _prompts() + _prefix_prompts()}
        out[name] = (capture(tiny_dirs[name]), ref)
    return out


def engine(graph, **kw) -> LLMEngine:
    return LLMEngine.from_graph(graph, **kw)


def blocks_budget(graph, num_blocks: int, block_size: int = 16) -> int:
    return num_blocks * KVCacheSpec.from_meta(graph.meta, block_size, torch.float32).bytes_per_block


@pytest.mark.parametrize("name", MODELS)
def test_batch_matches_hf(setups, name):
    graph, ref = setups[name]
    eng = engine(graph)
    outs = eng.generate(_prompts(), GREEDY)
    for p, o in zip(_prompts(), outs):
        assert o.token_ids == ref[tuple(p)], f"prompt of {len(p)} tokens"
        assert o.finish_reason == "length" and o.error is None
    assert eng.stats["preemptions"] == 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks  # everything released


@pytest.mark.parametrize("name", MODELS)
def test_staggered_arrival_matches_hf(setups, name):
    graph, ref = setups[name]
    eng = engine(graph)
    prompts = _prompts()[::-1]  # long prompts first, short ones join mid-decode
    results: dict[str, list[int]] = {}
    ids: dict[str, list[int]] = {}
    step = 0
    while prompts or eng.has_unfinished():
        if prompts and step % 3 == 0:
            p = prompts.pop(0)
            ids[eng.add_request(p, GREEDY)] = p
        for o in eng.step():
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    assert len(results) == len(LENGTHS)
    for rid, toks in results.items():
        assert toks == ref[tuple(ids[rid])], f"prompt of {len(ids[rid])} tokens"


@pytest.mark.parametrize("name", MODELS)
def test_preemption_matches_hf(setups, name):
    graph, ref = setups[name]
    # 20 blocks of 16 = 320 tokens: the longest request (200 + 32) fits alone, all 8 never do.
    eng = engine(graph, block_size=16, kv_cache_budget_bytes=blocks_budget(graph, 20))
    assert eng.config.num_blocks == 20
    outs = eng.generate(_prompts(), GREEDY)
    assert eng.stats["preemptions"] > 0
    assert sum(o.num_preemptions for o in outs) == eng.stats["preemptions"]
    for p, o in zip(_prompts(), outs):
        assert o.token_ids == ref[tuple(p)], f"prompt of {len(p)} tokens"


@pytest.mark.parametrize("name", MODELS)
def test_prefix_cache_reuses_blocks(setups, name):
    graph, ref = setups[name]
    eng = engine(graph, block_size=16)
    first, second = _prefix_prompts()
    r1 = eng.add_request(first, GREEDY)
    got: dict[str, list[int]] = {}
    while not got.get(r1):  # the first prompt's prefill is done (and its blocks hashed)
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    hits_before = eng.block_manager.stats.prefix_hit_blocks
    r2 = eng.add_request(second, GREEDY)
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert eng.block_manager.stats.prefix_hit_blocks - hits_before == 64 // 16
    assert got[r1] == ref[tuple(first)]
    assert got[r2] == ref[tuple(second)]


@pytest.mark.parametrize("name", MODELS)
def test_prefix_cache_survives_finish_and_is_evicted_under_pressure(setups, name):
    graph, ref = setups[name]
    first, second = _prefix_prompts()
    eng = engine(graph, block_size=16, kv_cache_budget_bytes=blocks_budget(graph, 12))
    assert eng.generate([first], GREEDY)[0].token_ids == ref[tuple(first)]
    out = eng.generate([second], GREEDY)[0]  # the first request finished; its blocks are free but cached
    assert out.num_cached_tokens == 64 and out.token_ids == ref[tuple(second)]
    third = _prompts()[5]  # 129 + 32 tokens need 11 of the 12 blocks: cached ones are handed out again
    assert eng.generate([third], GREEDY)[0].token_ids == ref[tuple(third)]
    assert eng.block_manager.stats.evicted_blocks > 0
    assert eng.generate([first], GREEDY)[0].num_cached_tokens < 64


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_same_tokens(setups, name):
    graph, ref = setups[name]
    whole = engine(graph, prefill_chunk_size=512, max_batched_tokens=4096)
    chunked = engine(graph, prefill_chunk_size=16, max_batched_tokens=64)
    a = [o.token_ids for o in whole.generate(_prompts(), GREEDY)]
    b = [o.token_ids for o in chunked.generate(_prompts(), GREEDY)]
    assert a == b
    assert a == [ref[tuple(p)] for p in _prompts()]
    assert chunked.stats["steps"] > whole.stats["steps"]  # the 200-token prompt took >= 13 steps


def test_rejects_too_long_prompts_while_others_run(setups):
    graph, ref = setups["tiny-llama"]
    eng = engine(graph, block_size=16, kv_cache_budget_bytes=blocks_budget(graph, 10))  # 160 tokens
    ok = _prompts()[:4]
    long_pos = [5] * 600  # > max_position_embeddings 512
    long_kv = _prompts()[-1]  # 200 tokens > the 160-token cache
    outs = eng.generate([ok[0], long_pos, ok[1], long_kv, ok[2], ok[3]], GREEDY)
    assert "600 tokens" in outs[1].error and "max_position_embeddings" in outs[1].error
    assert "KV cache holds 160" in outs[3].error and "kv_cache_budget_bytes" in outs[3].error
    assert outs[1].finish_reason == outs[3].finish_reason == "rejected" and not outs[1].token_ids
    for p, o in zip(ok, [outs[0], outs[2], outs[4], outs[5]]):
        assert o.error is None and o.token_ids == ref[tuple(p)]
    # the same through add_request, while a request is in flight
    rid = eng.add_request(ok[3], GREEDY)
    eng.step()
    with pytest.raises(RequestRejected, match="max_position_embeddings"):
        eng.add_request(long_pos, GREEDY)
    toks: list[int] = []
    while eng.has_unfinished():
        toks += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    assert toks == ref[tuple(ok[3])][1:]  # the first token came from the step before the rejection


def test_stream_yields_every_token_once(setups):
    graph, ref = setups["tiny-qwen3"]
    eng = engine(graph)
    prompts = _prompts()[:3]
    acc: dict[str, list[int]] = {}
    finished = set()
    for o in eng.stream(prompts, GREEDY):
        acc.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert o.request_id not in finished
        if o.finished:
            finished.add(o.request_id)
            assert o.token_ids == acc[o.request_id]
    assert [acc[k] for k in sorted(acc, key=int)] == [ref[tuple(p)] for p in prompts]


def test_stop_tokens_max_tokens_and_eos(setups):
    graph, ref = setups["tiny-llama"]
    p = _prompts()[2]
    want = ref[tuple(p)]
    eng = engine(graph)
    stop_at = want[5]
    first = want.index(stop_at)
    o = eng.generate(p, SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=(stop_at,), ignore_eos=True))[0]
    assert o.token_ids == want[: first + 1] and o.finish_reason == "stop"
    o = eng.generate(p, SamplingParams(temperature=0, max_tokens=3))[0]
    assert o.finish_reason in ("length", "stop") and o.token_ids == want[: len(o.token_ids)] and len(o.token_ids) <= 3
    eng.eos_token_id = want[4]  # pretend the model's EOS is the 5th greedy token
    o = eng.generate(p, SamplingParams(temperature=0, max_tokens=NEW))[0]
    assert o.token_ids == want[: want.index(want[4]) + 1] and o.finish_reason == "stop"


def test_seeded_sampling_is_independent_of_batch(setups):
    graph, _ = setups["tiny-qwen3"]
    sp = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = engine(graph).generate(_prompts()[3], sp)[0].token_ids
    other = SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    batched = engine(graph, seed=99).generate(_prompts()[:4], [other, other, other, sp])[3].token_ids
    assert alone == batched and len(alone) == 12


def test_single_long_prompt_chunked_steps_with_nothing_due(setups):
    """One 200-token prompt in chunks of 16: twelve steps sample nothing (the program still
    computes lm_head rows for the step's sequences); the tokens still equal HF's."""
    graph, ref = setups["tiny-qwen3"]
    eng = engine(graph, prefill_chunk_size=16, max_batched_tokens=16)
    assert "logits_indices" in eng.executable.input_names  # the row-selecting program is what runs
    p = _prompts()[-1]
    (out,) = eng.generate([p], GREEDY)
    assert out.token_ids == ref[tuple(p)]
    assert eng.stats["steps"] >= 13 + NEW - 1
