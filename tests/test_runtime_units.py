"""Block manager, scheduler and sampler in isolation (no model): bookkeeping and filters."""

from __future__ import annotations

import pytest
import torch

from portlayer.runtime.block_manager import BlockManager
from portlayer.runtime.sampler import Sampler, apply_top_k_top_p
from portlayer.runtime.scheduler import Scheduler, SchedulerConfig
from portlayer.runtime.sequence import SamplingParams, Sequence


def seq(i: int, n: int, params: SamplingParams | None = None) -> Sequence:
    return Sequence(i, str(i), list(range(100 * i, 100 * i + n)), params or SamplingParams(temperature=0))


def complete(s: Sequence, bm: BlockManager, n: int) -> None:
    """What the engine does after a step that computed ``n`` tokens of ``s``."""
    s.num_computed_tokens += n
    bm.register_computed(s)


# ---- block manager -------------------------------------------------------------------
def test_allocate_free_and_refcounts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(1, 10)
    assert bm.allocate_slots(a, 10) and len(a.block_table) == 3 and bm.num_free_blocks == 5
    assert not bm.allocate_slots(seq(2, 30), 30)  # 8 blocks needed, 5 free: nothing taken
    assert bm.num_free_blocks == 5
    bm.free_seq(a)
    assert bm.num_free_blocks == 8 and a.block_table == [] and a.num_computed_tokens == 0


def test_prefix_hit_shares_blocks_and_keeps_last_token_private():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Sequence(0, "a", list(range(12)), SamplingParams())
    bm.allocate_slots(a, 12)
    complete(a, bm, 12)
    b = Sequence(1, "b", list(range(12)), SamplingParams())  # identical prompt: 2 of 3 blocks reusable
    hits = bm.lookup_prefix(b.token_ids)
    assert hits == a.block_table[:2]
    assert bm.admission_cost(hits, 12) == 1
    bm.take_prefix(b, hits)
    assert b.num_computed_tokens == 8 and all(bm.ref_counts[x] == 2 for x in hits)
    c = Sequence(2, "c", list(range(8)) + [99, 98, 97, 96, 95], SamplingParams())
    assert bm.lookup_prefix(c.token_ids) == hits  # diverges in the third block
    d = Sequence(3, "d", [1] + list(range(1, 12)), SamplingParams())
    assert bm.lookup_prefix(d.token_ids) == []  # first block differs: chain broken from the start


def test_uncomputed_blocks_are_not_hittable_and_freed_ones_are_until_reused():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = Sequence(0, "a", list(range(9)), SamplingParams())
    bm.allocate_slots(a, 9)
    assert bm.lookup_prefix(list(range(9))) == []  # allocated, K/V not written yet
    complete(a, bm, 9)
    assert len(bm.lookup_prefix(list(range(9)))) == 2
    bm.free_seq(a)
    hits = bm.lookup_prefix(list(range(9)))
    assert len(hits) == 2 and bm.admission_cost(hits, 9) == 3  # reviving free cached blocks costs them
    e = seq(5, 16)
    assert bm.allocate_slots(e, 16)  # takes all four blocks: the cache is evicted
    assert bm.lookup_prefix(list(range(9))) == [] and bm.stats.evicted_blocks == 2


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = Sequence(0, "a", list(range(12)), SamplingParams())
    bm.allocate_slots(a, 12)
    complete(a, bm, 12)
    assert bm.lookup_prefix(list(range(12))) == []


# ---- scheduler -----------------------------------------------------------------------
def test_chunks_budget_and_prefills_first():
    bm = BlockManager(num_blocks=64, block_size=4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=8, max_batched_tokens=20, chunk_size=8), bm)
    a, b = seq(1, 3), seq(2, 30)
    sch.add(a)
    sch.add(b)
    batch = sch.schedule()
    assert [(s.seq_id, n) for s, n in batch.items] == [(1, 3), (2, 8)]
    complete(a, bm, 3)
    complete(b, bm, 8)
    a.append_token(7)  # a is now decoding
    batch = sch.schedule()
    assert [(s.seq_id, n) for s, n in batch.items] == [(2, 8), (1, 1)]  # prefill chunk before the decode


def test_preempts_newest_and_readmits_it_first():
    bm = BlockManager(num_blocks=6, block_size=4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=8, max_batched_tokens=64, chunk_size=64), bm)
    old, new, late = seq(1, 8), seq(2, 8), seq(3, 4)
    for s in (old, new, late):
        sch.add(s)
    batch = sch.schedule()
    assert [s.seq_id for s, _ in batch.items] == [1, 2, 3] and bm.num_free_blocks == 1
    for s, n in batch.items:
        complete(s, bm, n)
        s.append_token(1)
    for _ in range(4):  # decode: old needs a third block at 9 tokens, new too, late a second
        batch = sch.schedule()
        for s, n in batch.items:
            complete(s, bm, n)
            s.append_token(1)
    assert sch.num_preemptions >= 1 and late.num_preemptions >= 1
    assert old.num_preemptions == 0  # the oldest request always progresses
    assert sch.waiting[0] is late or late in sch.running


def test_waiting_queue_is_fifo():
    bm = BlockManager(num_blocks=4, block_size=4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=8, max_batched_tokens=64, chunk_size=64), bm)
    big, small = seq(1, 20), seq(2, 2)  # big needs 5 blocks > 4: it waits, and small must not overtake
    sch.add(big)
    sch.add(small)
    assert sch.schedule().empty


# ---- sampler -------------------------------------------------------------------------
def test_top_k_and_top_p_masks():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    assert torch.isfinite(apply_top_k_top_p(logits, 2, 1.0)).tolist() == [[False, True, True, False, False]]
    p = torch.softmax(logits, -1)[0]  # sorted: 4 (.64), 3 (.24), 2 (.09), ...
    keep = torch.isfinite(apply_top_k_top_p(logits, 0, float(p[1] + 0.01))).tolist()[0]
    assert keep == [False, True, True, False, False]  # the nucleus needs the second token to pass top_p
    assert torch.isfinite(apply_top_k_top_p(logits, 0, 0.01)).sum() == 1  # always keeps the best


def test_sampler_greedy_and_seeded():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    greedy = [seq(i, 1) for i in range(3)]
    assert Sampler()(logits, greedy) == logits.argmax(-1).tolist()
    sp = SamplingParams(temperature=1.0, seed=3)
    a = [Sampler()(logits[:1], [seq(0, 1, sp)])[0] for _ in range(3)]
    assert len(set(a)) == 1  # same seed, same draw
    s = seq(0, 1, sp)
    draws = [Sampler()(logits[:1], [s])[0] for _ in range(20)]
    assert len(set(draws)) > 1  # the stream advances within one request
    cold = SamplingParams(temperature=1e-4, seed=1)
    assert Sampler()(logits, [seq(i, 1, cold) for i in range(3)]) == logits.argmax(-1).tolist()


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
