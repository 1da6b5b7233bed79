"""Overlapped steps (runtime/overlap.py) against HF ``generate``: the engine's scenarios of
tests/test_runtime_generate.py — batching, staggered arrival, preemption, prefix caching, chunked
prefill, streaming, stop tokens and EOS, seeded sampling — rerun on tiny Qwen3 with ``overlap=True``
on the CPU (where it is off by default: the CPU backend does not run ahead of the host), plus aborts
while a step is in flight. The tokens must be HF's; no placeholder may ever reach an output.
"""

from __future__ import annotations

import pytest
import test_runtime_generate as base

from portlayer.runtime.engine import LLMEngine
from portlayer.runtime.sequence import SamplingParams

NAME = "tiny-qwen3"
ENGINES: list[LLMEngine] = []


def _overlapped(graph, **kw) -> LLMEngine:
    eng = LLMEngine.from_graph(graph, overlap=True, **kw)
    ENGINES.append(eng)
    return eng


@pytest.fixture(scope="module")
def setups(tiny_dirs):
    """tiny Qwen3's captured graph and HF's greedy tokens for every prompt of the scenarios."""
    from conftest import hf_model

    from portlayer.flatten import capture

    hf = hf_model(tiny_dirs[NAME])
    ref = {tuple(p): base.hf_generate(hf, p) for p in base._prompts() + base._prefix_prompts()}
    return {NAME: (capture(tiny_dirs[NAME]), ref)}


@pytest.fixture(autouse=True)
def overlapped_engines(monkeypatch):
    """Every engine the scenarios build overlaps its steps; afterwards nothing is left in flight."""
    monkeypatch.setattr(base, "engine", _overlapped)
    ENGINES.clear()
    yield
    for eng in ENGINES:
        assert not eng.has_unfinished()
        assert eng.step() == [] and eng._inflight is None  # a step left in flight held only finished requests
        for seq in eng.requests.values():
            assert min(seq.output_token_ids, default=0) >= 0


@pytest.mark.parametrize("scenario", [
    "test_batch_matches_hf", "test_staggered_arrival_matches_hf", "test_preemption_matches_hf",
    "test_prefix_cache_reuses_blocks", "test_chunked_prefill_same_tokens",
])  # fmt: skip
def test_engine_scenario_overlapped(setups, scenario):
    getattr(base, scenario)(setups, NAME)


def test_stream_seeded_and_chunked_overlapped(setups):
    base.test_stream_yields_every_token_once(setups)
    base.test_seeded_sampling_is_independent_of_batch(setups)  # sampled steps run synchronously
    base.test_single_long_prompt_chunked_steps_with_nothing_due(setups)


def test_greedy_steps_overlap_and_release_everything(setups):
    graph, ref = setups[NAME]
    eng = _overlapped(graph)
    outs = eng.generate(base._prompts(), base.GREEDY)
    assert [o.token_ids for o in outs] == [ref[tuple(p)] for p in base._prompts()]
    assert eng.stats["overlapped_steps"] >= base.NEW - 1  # every decode step ran ahead of the host
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_stop_tokens_and_eos_overlapped(setups):
    """A stop is known one step late; the extra token computed meanwhile never shows."""
    graph, ref = setups[NAME]
    prompts = base._prompts()[:4]
    eng = _overlapped(graph)
    want = ref[tuple(prompts[2])]
    eng.eos_token_id = want[4]  # pretend the model's EOS is the 5th greedy token of one prompt
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=base.NEW))
    for p, o in zip(prompts, outs):
        full = ref[tuple(p)]
        stop = full.index(want[4]) + 1 if want[4] in full else len(full)
        assert o.token_ids == full[:stop] and o.finish_reason == ("stop" if stop < len(full) or full[-1] == want[4]
                                                                  else "length")
    stop_at = want[7]
    o = eng.generate(prompts[2], SamplingParams(temperature=0, max_tokens=base.NEW, stop_token_ids=(stop_at,),
                                                ignore_eos=True))[0]
    assert o.token_ids == want[: want.index(stop_at) + 1] and o.finish_reason == "stop"
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_abort_while_a_step_is_in_flight(setups):
    graph, ref = setups[NAME]
    eng = _overlapped(graph)
    prompts = base._prompts()[:4]
    ids = [eng.add_request(p, base.GREEDY) for p in prompts]
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
