"""Interpreter tier for attention: reshape_and_cache, split-K paged decode, paged varlen
prefill (prefix caching / chunked prefill: new tokens after cached ones) and cache-less
varlen attention, each against the reference attention op on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from triton_harness import (
    build_program,
    h200_few_sms,
    paged_setup,
    record_launches,
    reference,
    rel_err,
    tol,
    use_interpreter,
)

from portlayer.flatten.ir import GraphBuilder, TensorType

pytestmark = pytest.mark.interpreter


@pytest.fixture(autouse=True)
def _interp(monkeypatch):
    use_interpreter(monkeypatch)


def _graph(dtype: torch.dtype, hq: int, hkv: int, d: int, **attrs):
    dt = str(dtype).replace("torch.", "")
    b = GraphBuilder()
    q = b.add_input("q", TensorType(dt, ("num_tokens", hq, d)))
    k = b.add_input("k", TensorType(dt, ("num_tokens", hkv, d)))
    v = b.add_input("v", TensorType(dt, ("num_tokens", hkv, d)))
    b.graph.outputs = [b.add1("attention", [q, k, v], {"num_heads": hq, "num_kv_heads": hkv, "head_dim": d, **attrs})]
    return b.graph


def _feeds(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype):
    return {"q": torch.randn(t, hq, d).to(dtype), "k": torch.randn(t, hkv, d).to(dtype),
            "v": torch.randn(t, hkv, d).to(dtype)}


CASES = [
    # (cached, new) per sequence: decodes, prefills after a cached prefix, plain prefills
    pytest.param([(0, 7), (20, 1), (33, 1)], 4, 2, 16, {}, id="prefill+decode-gqa2"),
    pytest.param([(16, 9), (5, 1)], 8, 2, 32, {}, id="prefix-cached-prefill-gqa4"),
    pytest.param([(40, 1), (0, 1), (70, 1)], 2, 2, 16, {}, id="decode-only-mha"),
    pytest.param([(3, 12), (50, 1)], 4, 1, 16, {"sliding_window": 8}, id="sliding-window-mqa"),
    pytest.param([(0, 10), (17, 1)], 4, 2, 16, {"softcap": 5.0, "scale": 0.3}, id="softcap"),
    # long enough that whole key blocks lie before a query block's first position (the unmasked loop),
    # a head_dim below its power-of-two block (masked head dims), and softcap over unmasked blocks
    pytest.param([(0, 150), (70, 40), (9, 1)], 4, 2, 16, {}, id="long-prefill-unmasked-blocks"),
    pytest.param([(0, 90), (40, 30)], 2, 1, 24, {}, id="long-prefill-odd-head-dim"),
    pytest.param([(64, 80)], 2, 2, 16, {"softcap": 5.0}, id="long-prefill-softcap"),
]


@pytest.mark.parametrize("dtype,kv", [(torch.float32, None), (torch.float16, "float16"),
                                      (torch.float16, "float8_e4m3fn")], ids=["fp32", "fp16", "fp16-fp8cache"])
@pytest.mark.parametrize("seqs,hq,hkv,d,attrs", CASES)
def test_paged_attention(tmp_path, dtype, kv, seqs, hq, hkv, d, attrs):
    """The generated attention kernels (KV write, paged prefill, split-K decode) against the reference op on the same
    caches; a float8 cache: both round what they write to e4m3 and read it back (templates/triton/_kv_cache.j2)."""
    graph = _graph(dtype, hq, hkv, d, **attrs)
    meta, kc, vc = paged_setup(seqs, hkv, d, dtype, seed=len(seqs) * 7 + hq)
    t = int(meta.query_start_loc[-1])
    feeds = _feeds(t, hq, hkv, d, dtype)
    _, prog = build_program(graph, tmp_path, kv_cache_dtype=kv)
    assert prog.kv_dtype == getattr(torch, kv or "float32")
    kc, vc = kc.to(prog.kv_dtype), vc.to(prog.kv_dtype)
    ours_caches = [(kc.clone(), vc.clone())]
    ref_caches = [(kc.clone(), vc.clone())]
    (ours,) = prog.run(feeds, meta, ours_caches)
    (want,) = reference(graph, feeds, meta, ref_caches)
    assert rel_err(ours, want) <= tol(dtype)
    assert torch.equal(ours_caches[0][0], ref_caches[0][0]) and torch.equal(ours_caches[0][1], ref_caches[0][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_attention_without_cache(tmp_path, dtype, causal):
    from portlayer.flatten.op_defs.attention import AttentionMetadata

    graph = _graph(dtype, 4, 2, 16, causal=causal)
    meta = AttentionMetadata.from_lens([5, 1, 11])
    feeds = _feeds(17, 4, 2, 16, dtype)
    _, prog = build_program(graph, tmp_path)
    (ours,) = prog.run(feeds, meta, None)
    (want,) = reference(graph, feeds, meta, None)
    assert rel_err(ours, want) <= tol(dtype)


def test_negative_slots_are_not_written(tmp_path):
    graph = _graph(torch.float32, 2, 2, 16)
    meta, kc, vc = paged_setup([(0, 4)], 2, 16, torch.float32)
    meta.slot_mapping[1] = -1
    _, prog = build_program(graph, tmp_path)
    caches = [(kc.clone(), vc.clone())]
    prog.run(_feeds(4, 2, 2, 16, torch.float32), meta, caches)
    untouched = int(meta.block_tables[0, 0]) * 16 + 1
    assert torch.equal(caches[0][0].view(-1, 2, 16)[untouched], kc.view(-1, 2, 16)[untouched])


def _decode_cfg(d: int, tokens: int, programs: int) -> dict[str, int]:
    return {"num_warps": 2, "num_stages": 1, "BLOCK_H": 16, "TILE": tokens * d, "BLOCK_D": d, "PROGRAMS": programs}


SPLIT_CASES = [
    # (descriptor, PROGRAMS, decode sequences' cached tokens, splits the step takes, GQA heads, attrs)
    # 3 sequences x 2 KV heads = 6 programs >= 4 SMs x 1: one split, the kernel writes the output (no reduce)
    pytest.param("4sm", 1, [40, 3, 70], 1, {}, id="one-split-writes-the-output"),
    # 40 x 2 = 80 programs, 132 SMs: two of the scratch's 16 splits (the reduce reads only the two)
    pytest.param("h200", 1, [(7 * i) % 45 for i in range(40)], 2, {}, id="two-of-sixteen-splits"),
    # 3 x 2 programs against 264: every split the scratch holds; the short sequence leaves most of them empty
    pytest.param("h200", 2, [40, 0, 70], 16, {}, id="all-splits-some-empty"),
    # a window: the tiles before it are not read, and the split ranges cover only the window's tiles
    pytest.param("h200", 2, [90, 5, 61], 16, {"sliding_window": 20}, id="window-all-splits"),
    pytest.param("4sm", 1, [90, 5, 61], 1, {"sliding_window": 20}, id="window-one-split"),
]


@pytest.mark.parametrize("block_size,tokens", [(16, 16), (8, 64), (32, 16), (16, 64)])
@pytest.mark.parametrize("target,programs,cached,splits,attrs", SPLIT_CASES)
def test_decode_attention_splits_and_pages(tmp_path, monkeypatch, target, programs, cached, splits, attrs,
                                           block_size, tokens):
    """The split-K decode kernel at the splits a step's batch asks for (host_support.decode_splits), with steps of
    BLOCK_N tokens gathered through the block table across pages smaller and larger than a step: against the
    reference op, and the reduce launched exactly when the step split."""
    hq, hkv, d, dtype = 4, 2, 16, torch.float32
    graph = _graph(dtype, hq, hkv, d, **attrs)
    seqs = [(c, 1) for c in cached]
    blocks = sum(-(-(c + 1) // block_size) for c in cached) + 2
    meta, kc, vc = paged_setup(seqs, hkv, d, dtype, block_size=block_size, num_blocks=blocks, seed=len(seqs))
    feeds = _feeds(len(seqs), hq, hkv, d, dtype)
    desc = str(h200_few_sms(tmp_path)) if target == "4sm" else "nvidia-h200"
    launches: list[str] = []
    record_launches(monkeypatch, launches)
    _, prog = build_program(graph, tmp_path / "p", target=desc, max_seqs=64,
                            launch={"attention_decode": _decode_cfg(d, tokens, programs)})
    ours_caches, ref_caches = [(kc.clone(), vc.clone())], [(kc.clone(), vc.clone())]
    (ours,) = prog.run(feeds, meta, ours_caches)
    (want,) = reference(graph, feeds, meta, ref_caches)
    assert rel_err(ours, want) <= tol(dtype)
    reduces = [n for n in launches if n.startswith("attn_decode") and n.endswith("_reduce")]
    decodes = [n for n in launches if n.startswith("attn_decode") and not n.endswith("_reduce")]
    assert len(decodes) == 1 and len(reduces) == (0 if splits == 1 else 1), launches
    from portlayer.codegen.host_support import decode_splits

    cus = 4 if target == "4sm" else 132
    assert decode_splits(len(seqs), hkv, programs * cus, 16 if target == "h200" else 2) == splits


@pytest.mark.parametrize("target,programs", [("4sm", 1), ("h200", 2)], ids=["one-split", "sixteen-splits"])
@pytest.mark.parametrize("kv", [None, "float8_e4m3fn"], ids=["fp32", "fp16-fp8cache"])
def test_padded_graph_rows_read_as_empty_sequences(tmp_path, monkeypatch, target, programs, kv):
    """A captured decode graph's rows past the batch hold no sequence (length 0, slot -1; HostProgram._pad_from): the
    kernel writes zeros there on both the one-split (direct) and the many-split (reduce) path, and the real rows match
    the reference op."""
    hq, hkv, d = 4, 2, 16
    dtype = torch.float32 if kv is None else torch.float16
    graph = _graph(dtype, hq, hkv, d)
    meta, kc, vc = paged_setup([(40, 1), (5, 1), (70, 1), (3, 1)], hkv, d, dtype, num_blocks=16, seed=2)
    meta.seq_lens[[1, 3]] = 0
    meta.slot_mapping[[1, 3]] = -1
    desc = str(h200_few_sms(tmp_path)) if target == "4sm" else "nvidia-h200"
    _, prog = build_program(graph, tmp_path / "p", target=desc, max_seqs=64, kv_cache_dtype=kv,
                            launch={"attention_decode": _decode_cfg(d, 16, programs)})
    kc, vc = kc.to(prog.kv_dtype), vc.to(prog.kv_dtype)
    feeds = _feeds(4, hq, hkv, d, dtype)
    (ours,) = prog.run(feeds, meta, [(kc.clone(), vc.clone())])
    (want,) = reference(graph, feeds, meta, [(kc.clone(), vc.clone())])
    assert torch.isfinite(ours).all() and float(ours[[1, 3]].abs().max()) == 0.0
    assert rel_err(ours[[0, 2]], want[[0, 2]]) <= tol(dtype)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("window", [0, 20])
def test_mixed_step_decodes_after_prefills_at_one_split(tmp_path, monkeypatch, block_size, window):
    """Decode sequences after prefills (the kernel's seq_offset) when the step takes one split: the decode kernel
    writes the output itself and no reduce runs; against the reference op, across page sizes and a window."""
    hq, hkv, d, dtype = 4, 2, 16, torch.float32
    graph = _graph(dtype, hq, hkv, d, **({"sliding_window": window} if window else {}))
    meta, kc, vc = paged_setup([(0, 7), (30, 5), (20, 1), (33, 1), (90, 1)], hkv, d, dtype, block_size=block_size,
                               num_blocks=40, seed=5)
    launches: list[str] = []
    record_launches(monkeypatch, launches)
    _, prog = build_program(graph, tmp_path / "p", target=str(h200_few_sms(tmp_path)), max_seqs=64,
                            launch={"attention_decode": _decode_cfg(d, 64, 1)})
    feeds = _feeds(int(meta.query_start_loc[-1]), hq, hkv, d, dtype)
    (ours,) = prog.run(feeds, meta, [(kc.clone(), vc.clone())])
    (want,) = reference(graph, feeds, meta, [(kc.clone(), vc.clone())])
    assert any(n.startswith("attn_decode") for n in launches) and not any(n.endswith("_reduce") for n in launches)
    assert rel_err(ours, want) <= tol(dtype)


SPLITS = [  # (cached, new) per sequence, in the step's order: 1-token sequences anywhere, query lengths at and
    # around BLOCK_M (16 here), many 2-token prefills, a sequence that starts mid-block
    pytest.param([(0, 16)], id="one-block"),
    pytest.param([(0, 15), (0, 1), (0, 17)], id="decode-between-prefills"),
    pytest.param([(3, 1), (0, 33), (5, 2), (0, 16), (2, 31)], id="mixed-lengths"),
    pytest.param([(0, 2)] * 9, id="many-2-token-prefills"),
    pytest.param([(4, 1)] * 5 + [(0, 40)], id="decodes-then-prefill"),
]


@pytest.mark.parametrize("seqs", SPLITS)
@pytest.mark.parametrize("mode", ["eager", "step-graph"])
def test_paged_prefill_finds_each_programs_sequence_for_any_split(tmp_path, seqs, mode):
    """The paged prefill's grid is T // BLOCK_M + S programs a head; each finds its sequence by bisection over
    query_start_loc (codegen/kernels/attention.py prefill_lines). Eager (prefills first, as the runner orders them)
    and as a step graph runs it (tokens padded to an odd T_b, empty slots with query_start_loc = T, decode
    programs from slot 0): the reference op's output for every real row."""
    from portlayer.codegen.host_support import StepState

    hq, hkv, d = 4, 2, 16
    graph = _graph(torch.float32, hq, hkv, d)
    if mode == "eager":
        seqs = sorted(seqs, key=lambda s: s[1] == 1)
    meta, kc, vc = paged_setup(seqs, hkv, d, torch.float32, num_blocks=64, seed=len(seqs))
    T, S = int(meta.query_start_loc[-1]), len(seqs)  # noqa: N806
    feeds = _feeds(T, hq, hkv, d, torch.float32)
    _, prog = build_program(graph, tmp_path, max_seqs=16, launch={"attention_prefill": {
        "BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}})
    (want,) = reference(graph, feeds, meta, [(kc.clone(), vc.clone())])
    caches = [(kc.clone(), vc.clone())]
    if mode == "eager":
        (got,) = prog.run(feeds, meta, caches)
    else:
        Tb, Sb = -(-T // 16) * 16 + 7, 16  # noqa: N806 - an odd bucket stresses T // BLOCK_M
        qsl = torch.full((Sb + 1,), T, dtype=torch.int32)
        qsl[: S + 1] = meta.query_start_loc
        lens = torch.zeros(Sb, dtype=torch.int32)
        lens[:S] = meta.seq_lens
        slots = torch.full((Tb,), -1, dtype=torch.int64)
        slots[:T] = meta.slot_mapping
        tables = torch.zeros(Sb, 8, dtype=torch.int32)
        tables[:S, : meta.block_tables.shape[1]] = meta.block_tables
        st = StepState(Tb, Sb, 1, Sb, Tb, qsl, lens, slots, tables, tables.stride(0), 16, True, None, caches,
                       torch.device("cpu"), decode_offset=0)
        padded = {k: torch.cat([v, torch.randn(Tb - T, *v.shape[1:])]) for k, v in feeds.items()}
        got = prog.forward(Tb, Sb, padded, st, caches)[0][:T]
    assert rel_err(got, want) <= tol(torch.float32), (seqs, rel_err(got, want))
