"""Bad input, part 3: the engine. Invalid sampling values are refused at add_request (nothing
queued); a request that fails inside a step (its program run raises, its logits are NaN, its
sampling raises) finishes with an error output, and every other request's tokens equal a
clean run without it; the engine goes on serving afterwards."""

from __future__ import annotations

import dataclasses
import math

import pytest
from artifact_samples import sample_graph

from portlayer.runtime.engine import LLMEngine
from portlayer.runtime.sequence import RequestRejected, SamplingParams

PROMPTS = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9, 10, 11, 12], "d": [13, 14]}
POISON = [20, 21, 22, 23, 24, 25, 26, 27, 28]  # the only prompt of 9 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True)


def engine(wrap=None) -> LLMEngine:
    g = sample_graph()
    g.meta.update(num_layers=1, num_kv_heads=2, head_dim=4)  # what capture records (ir_samples' shape)
    eng = LLMEngine.from_graph(g, max_num_seqs=8, kv_cache_budget_bytes=1 << 20)
    if wrap is not None:
        eng.runner.executable = wrap(eng.runner.executable)
    return eng


def params_of(rid: str) -> SamplingParams:
    return SEEDED if rid == "c" else GREEDY


def run_all(eng: LLMEngine, extra: dict[str, list[int]] | None = None, poison_params=None) -> dict[str, object]:
    for rid, ids in PROMPTS.items():
        eng.add_request(ids, params_of(rid), request_id=rid)
    for rid, ids in (extra or {}).items():
        eng.add_request(ids, GREEDY, request_id=rid)
        if poison_params:
            poison_params(eng.requests[rid])
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


@pytest.fixture(scope="module")
def clean() -> dict[str, list[int]]:
    outs = run_all(engine())
    assert all(o.error is None and len(o.token_ids) == 6 for o in outs.values())
    return {rid: list(o.token_ids) for rid, o in outs.items()}


def _query_lens(meta) -> list[int]:
    q = meta.query_start_loc.tolist()
    return [b - a for a, b in zip(q[:-1], q[1:])]


class RaisingOnPoison:
    """The program fails whenever the poisoned request's prefill (9 tokens) is in the step."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, feeds, meta, kv):
        if len(POISON) in _query_lens(meta):
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        return self.inner.run(feeds, meta, kv)


class NaNForPoison(RaisingOnPoison):
    """The program returns NaN logits for the poisoned request's row only."""

    def run(self, feeds, meta, kv):
        out = self.inner.run(feeds, meta, kv)
        lens = _query_lens(meta)
        if len(POISON) in lens:
            out = [out[0].clone(), *out[1:]]
            out[0][lens.index(len(POISON))] = float("nan")
        return out


def _check_others(outs, clean, poisoned_pattern: str) -> None:
    assert outs["p"].finish_reason == "error" and outs["p"].error
    assert poisoned_pattern in outs["p"].error and outs["p"].error.startswith("request p: ")
    assert {rid: list(o.token_ids) for rid, o in outs.items() if rid != "p"} == clean
    assert all(o.error is None for rid, o in outs.items() if rid != "p")


def test_nan_temperature_set_after_admission_fails_only_that_request(clean) -> None:
    """The issue's repro: temperature=nan inside step() used to break the engine for everyone."""
    eng = engine()
    outs = run_all(eng, {"p": POISON}, poison_params=lambda s: setattr(s, "params", _params(temperature=math.nan)))
    _check_others(outs, clean, "sampling failed")
    _serves_on(eng, clean)


def test_program_failure_fails_only_the_request_that_triggers_it(clean) -> None:
    eng = engine(RaisingOnPoison)
    outs = run_all(eng, {"p": POISON})
    _check_others(outs, clean, "the model step failed (RuntimeError: CUDA error")
    _serves_on(eng, clean)


def test_non_finite_logits_fail_only_their_request(clean) -> None:
    eng = engine(NaNForPoison)
    outs = run_all(eng, {"p": POISON})
    _check_others(outs, clean, "non-finite logits")
    _serves_on(eng, clean)


def _serves_on(eng: LLMEngine, clean) -> None:
    """After the failure the KV blocks are back and new requests come out as in a clean run."""
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    out = eng.generate([PROMPTS["b"]], GREEDY)[0]
    assert out.error is None and list(out.token_ids) == clean["b"]


def _params(**changes) -> SamplingParams:
    """GREEDY with fields set past SamplingParams' own checks (as a bug or a hand-built object would)."""
    p = dataclasses.replace(GREEDY)
    for k, v in changes.items():
        object.__setattr__(p, k, v)
    return p


@pytest.mark.parametrize("field,value,pattern", [
    ("temperature", math.nan, "must be a finite number >= 0"),
    ("temperature", math.inf, "must be a finite number >= 0"),
    ("temperature", -1.0, "must be a finite number >= 0"),
    ("temperature", 1e-30, "too small to sample with"),
    ("temperature", True, "must be a finite number >= 0"),
    ("temperature", "0.7", "must be a finite number >= 0"),
    ("top_p", math.nan, r"must be a finite number in \(0, 1\]"),
    ("top_p", 0.0, r"must be a finite number in \(0, 1\]"),
    ("top_p", 1.5, r"must be a finite number in \(0, 1\]"),
    ("top_k", 2.5, "must be an integer"),
    ("top_k", None, "must be an integer"),
    ("max_tokens", 0, "must be an integer >= 1"),
    ("max_tokens", 3.0, "must be an integer >= 1"),
    ("seed", -1, r"must be None or an integer in \[0, 2\*\*63\)"),
    ("seed", 1.5, r"must be None or an integer"),
    ("stop_token_ids", ("x",), "must be integers"),
])  # fmt: skip
def test_invalid_sampling_values_are_refused_at_add_request(field: str, value, pattern: str) -> None:
    eng = engine()
    with pytest.raises(RequestRejected, match=rf"request r1: sampling parameter {field}=.* {pattern}"):
        eng.add_request([1, 2, 3], _params(**{field: value}), request_id="r1")
    assert not eng.requests and not eng.scheduler.has_unfinished()  # nothing queued


@pytest.mark.parametrize("prompt,pattern", [
    ([], "the prompt is empty"),
    ([1, 2, 99], "token id 99 is outside"),
    ([-1], "token id -1 is outside"),
    (["a", "b"], "a prompt is a text or a list of integer token ids"),
    ([1] * 65, "allows at most 64 positions"),
    ("hello", "a text prompt needs a tokenizer"),
])  # fmt: skip
def test_invalid_prompts_are_refused_and_nothing_is_queued(prompt, pattern: str) -> None:
    eng = engine()
    with pytest.raises(RequestRejected, match=pattern):
        eng.add_request(prompt, GREEDY, request_id="r1")
    assert not eng.requests and not eng.scheduler.has_unfinished()


def test_duplicate_request_id_is_refused_and_the_first_is_kept(clean) -> None:
    eng = engine()
    eng.add_request(PROMPTS["a"], GREEDY, request_id="a")
    with pytest.raises(RequestRejected, match="request id 'a' is already in use"):
        eng.add_request(PROMPTS["b"], GREEDY, request_id="a")
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.finished]
    assert [list(o.token_ids) for o in outs] == [clean["a"]]


def test_generate_reports_a_rejected_prompt_in_place(clean) -> None:
    eng = engine()
    outs = eng.generate([PROMPTS["a"], PROMPTS["b"]], [GREEDY, _params(temperature=math.nan)])
    assert list(outs[0].token_ids) == clean["a"] and outs[0].error is None
    assert outs[1].finish_reason == "rejected" and "temperature=nan" in outs[1].error and outs[1].token_ids == []


def test_engine_generate_errors_carry_through_final_outputs(clean) -> None:
    eng = engine(RaisingOnPoison)
    outs = eng.generate([PROMPTS["a"], POISON, PROMPTS["d"]], GREEDY)
    assert [list(outs[0].token_ids), list(outs[2].token_ids)] == [clean["a"], clean["d"]]
    assert outs[1].finish_reason == "error" and "the model step failed" in outs[1].error and outs[1].text is None
