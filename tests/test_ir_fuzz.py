"""A seeded fuzzer of saved IR JSON: the loader plus the verifier give a clean error or a valid graph.

500 mutations of an optimised tiny graph's graph.json (kernel groups and memory plan included)
go through the real loading path (load_graph from bytes, then verify_graph). Each outcome must
be a GraphFileError / VerificationError (a PortlayerError or ValueError with a message), or an
accepted graph that really is valid: it round-trips through JSON and the reference interpreter
runs it, producing outputs of the declared dtypes and shapes. Anything else (a crash, or an
accepted graph the interpreter cannot run) fails the test with the seed to reproduce it.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch
from artifact_samples import sample_graph

N_MUTATIONS = 500
SEED = 20261201

WEIRD = [None, True, False, 0, -1, 1, 2**63, 1.5, float("nan"), "", "x", "num_tokens", "num_tokens + 1",
         "2*num_tokens", "num_tokens//2", "(num_tokens", "num_tokens +", "1e400", "num_tokens**99", "a b",
         "float32", "int64", "bogus_dtype", "rms_norm", [], [1], ["num_tokens"], {}, {"a": 1}, [[[]]]]  # fmt: skip


@pytest.fixture(autouse=True)
def _memo_dims(monkeypatch):
    """The dim parsers are pure functions of their argument; memoising symbolic strings keeps 500
    loads in seconds (each load re-parses ~100 dims with sympy). Outcomes are unchanged: failures
    are not memoised, and every module that imported a parser by name gets the same wrapper."""
    import portlayer.flatten.ir as ir
    import portlayer.flatten.op_defs.layout as layout

    for name in ("normalize_dim", "to_sympy"):
        original = getattr(ir, name, None)
        if original is None:
            continue
        memo: dict[str, object] = {}

        def cached(d, _original=original, _memo=memo):
            if not isinstance(d, str):
                return _original(d)
            if d not in _memo:
                _memo[d] = _original(d)
            return _memo[d]

        for mod in (ir, layout):
            if getattr(mod, name, None) is original:
                monkeypatch.setattr(mod, name, cached)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(graph.json text, weights bytes) of the sample graph after the CPU pass pipeline."""
    from portlayer.flatten.serialize import save_graph
    from portlayer.passes.pipeline import run_pipeline

    g = run_pipeline(sample_graph(), "cpu-x86_64").graph
    assert "kernels" in g.meta and "memory_plan" in g.meta
    d = tmp_path_factory.mktemp("fuzz")
    save_graph(g, d)
    return (d / "graph.json").read_text(), (d / "weights.safetensors").read_bytes()


def _paths(doc, prefix=()):
    """Every (container path, key) in the JSON document."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield prefix, k
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield prefix, i
            yield from _paths(v, (*prefix, i))


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def mutate(doc: dict, rng: random.Random) -> dict:
    doc = copy.deepcopy(doc)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        paths = list(_paths(doc))
        parent_path, key = rng.choice(paths)
        parent = _get(doc, parent_path)
        kind = rng.random()
        if kind < 0.45:
            parent[key] = copy.deepcopy(rng.choice(WEIRD))
        elif kind < 0.6 and isinstance(parent, dict):
            del parent[key]
        elif kind < 0.7 and isinstance(parent, list):
            parent.pop(key)
        elif kind < 0.8 and isinstance(parent, list) and len(parent) > 1:
            j = rng.randrange(len(parent))
            parent[key], parent[j] = parent[j], parent[key]
        elif kind < 0.9 and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        else:  # swap in a value from elsewhere in the document (a plausible but wrong reference)
            other_parent, other_key = rng.choice(paths)
            parent[key] = copy.deepcopy(_get(doc, other_parent)[other_key])
    return doc


def _interpret(graph) -> None:
    from portlayer.flatten.interpret import interpret
    from portlayer.flatten.ir import eval_dim, torch_dtype

    n = 3
    ins = {v.name: v.type for v in graph.inputs}
    if set(ins) != {"input_ids", "positions"} or any(t.shape != ("num_tokens",) for t in ins.values()):
        return  # a valid graph with another interface than the token stream: nothing to feed it
    outs = interpret(graph, input_ids=torch.tensor([1, 2, 3]), positions=torch.arange(n))
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    types = graph.value_types()
    for name, t in zip(graph.outputs, outs):
        want = types[name]
        assert t.dtype == torch_dtype(want.dtype), (name, t.dtype, want)
        assert list(t.shape) == [eval_dim(d, {"num_tokens": n, "num_seqs": 1}) for d in want.shape], (name, t.shape, want)


def check_one(text: str, weights: bytes, source: str) -> str:
    """'refused' or 'accepted'; raises AssertionError for a crash or an accepted invalid graph."""
    from portlayer.errors import PortlayerError
    from portlayer.flatten.serialize import graph_from_json, graph_to_json, load_graph
    from portlayer.flatten.verify import VerificationError, verify_graph

    files = {"graph.json": text.encode(), "weights.safetensors": weights}
    try:
        graph = load_graph(Path("/fuzz"), read=lambda name: files[name] if name in files else b"")
        verify_graph(graph)
    except (PortlayerError, VerificationError) as e:
        assert str(e), source
        return "refused"
    except Exception as e:  # noqa: BLE001 - any other exception is the bug this test looks for
        raise AssertionError(f"{source}: loader/verifier crashed with {type(e).__name__}: {e}") from e
    try:
        again = graph_from_json(json.loads(json.dumps(graph_to_json(graph))))
        assert graph_to_json(again) == graph_to_json(graph)
        _interpret(graph)
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{source}: the verifier accepted a graph that does not run: "
                             f"{type(e).__name__}: {str(e)[:500]}") from e
    return "accepted"


def test_fuzzed_graph_json_is_refused_cleanly_or_valid(saved) -> None:
    text, weights = saved
    doc = json.loads(text)
    assert check_one(text, weights, "unmutated") == "accepted"
    rng = random.Random(SEED)
    outcomes = {"refused": 0, "accepted": 0}
    failures = []
    for i in range(N_MUTATIONS):
        m = mutate(doc, rng)
        try:
            outcomes[check_one(json.dumps(m), weights, f"mutation {i} (seed {SEED})")] += 1
        except AssertionError as e:
            failures.append(str(e).splitlines()[0][:300])
    assert not failures, f"{len(failures)} of {N_MUTATIONS} mutations:\n" + "\n".join(failures[:15])
    assert outcomes["refused"] > N_MUTATIONS // 3 and outcomes["accepted"] > 10, outcomes


@pytest.mark.parametrize("damage", ["truncate", "flip", "deep", "empty", "binary"])
def test_damaged_graph_json_bytes_are_refused(saved, damage: str) -> None:
    text, weights = saved
    rng = random.Random(damage)
    bad = {"truncate": text[: len(text) // 3], "empty": "", "deep": "[" * 200_000,
           "flip": "".join(c if rng.random() > 0.002 else rng.choice("{}[],:\"x") for c in text),
           "binary": "\x00\xff" * 100}[damage]
    assert check_one(bad, weights, damage) == "refused"
