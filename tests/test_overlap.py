"""Overlapped steps (runtime/overlap.py) against HF ``generate``: the engine's scenarios of
tests/test_runtime_generate.py — batching, staggered arrival, preemption, prefix caching, chunked
prefill, streaming, stop tokens and EOS, seeded sampling — rerun with ``overlap=True`` on the CPU
(where it is off by default: the CPU backend does not run ahead of the host), plus aborts while a
step is in flight. The tokens must be HF's; no placeholder may ever reach an output.
"""

from __future__ import annotations

import pytest
import test_runtime_generate as base
from test_runtime_generate import (  # noqa: F401 - collected here with the overlapped engine
    GREEDY,
    _prompts,
    setups,
    test_batch_matches_hf,
    test_chunked_prefill_same_tokens,
    test_preemption_matches_hf,
    test_prefix_cache_reuses_blocks,
    test_seeded_sampling_is_independent_of_batch,
    test_single_long_prompt_chunked_steps_with_nothing_due,
    test_staggered_arrival_matches_hf,
    test_stop_tokens_max_tokens_and_eos,
    test_stream_yields_every_token_once,
)

from portlayer.runtime.engine import LLMEngine

ENGINES: list[LLMEngine] = []


def _overlapped(graph, **kw) -> LLMEngine:
    eng = LLMEngine.from_graph(graph, overlap=True, **kw)
    ENGINES.append(eng)
    return eng


@pytest.fixture(autouse=True)
def overlapped_engines(monkeypatch):
    """Every engine these tests build overlaps its steps; each greedy test must really have overlapped."""
    monkeypatch.setattr(base, "engine", _overlapped)
    ENGINES.clear()
    yield
    for eng in ENGINES:
        assert not eng.has_unfinished()
        assert eng.step() == [] and eng._inflight is None  # a step left in flight held only finished requests
        for seq in eng.requests.values():
            assert min(seq.output_token_ids, default=0) >= 0


def test_greedy_steps_overlap_and_release_everything(setups):  # noqa: F811
    graph, ref = setups["tiny-qwen3"]
    eng = _overlapped(graph)
    outs = eng.generate(_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == [ref[tuple(p)] for p in _prompts()]
    assert eng.stats["overlapped_steps"] >= base.NEW - 1  # every decode step ran ahead of the host
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_abort_while_a_step_is_in_flight(setups):  # noqa: F811
    graph, ref = setups["tiny-qwen3"]
    eng = _overlapped(graph)
    prompts = _prompts()[:4]
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    got: dict[str, list[int]] = {}
    for step in range(200):
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if step == 6:
            assert eng._inflight is not None
            eng.abort_request(ids[1])
        if not eng.has_unfinished():
            break
    for rid, p in zip(ids, prompts):
        if rid != ids[1]:
            assert got[rid] == ref[tuple(p)]
    assert all(t >= 0 for toks in got.values() for t in toks)
    assert got[ids[1]] == ref[tuple(prompts[1])][: len(got[ids[1]])] and len(got[ids[1]]) < base.NEW
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
