"""The generated paged decode attention kernel (codegen/templates/triton/attention_decode.py.j2) under the
Triton interpreter against torch SDPA (fp32 softmax) on a dense copy of the same KV: batch sizes, ragged and
empty sequences, GQA groups, sliding window, softcap, page sizes 16 and 128, BLOCK_N smaller and larger than
a page, batch 1, 3 and 64, and the split counts the host can pick (1: no reduce), plus the generated host program's launches."""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from portlayer.codegen.kernels.attention import build_decode, decode_splits, num_splits, splits_expr
from portlayer.codegen.kernels.context import GenContext
from portlayer.flatten.ir import GraphBuilder, TensorType

#: half precision runs as float16: the Triton 3.9 interpreter's tl.dot on bfloat16 returns garbage on the CPU
#: (bf16 is checked against SDPA on the GPU by scripts/gpu_attn_decode.py)
TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16}


def attention_graph(hq: int, hkv: int, d: int, dtype: str, window: int = 0, softcap: float = 0.0):
    b = GraphBuilder()
    q = b.add_input("q", TensorType(dtype, ("num_tokens", hq, d)))
    k = b.add_input("k", TensorType(dtype, ("num_tokens", hkv, d)))
    v = b.add_input("v", TensorType(dtype, ("num_tokens", hkv, d)))
    attrs = {"num_heads": hq, "num_kv_heads": hkv, "head_dim": d}
    if window:
        attrs["sliding_window"] = window
    if softcap:
        attrs["softcap"] = softcap
    b.graph.outputs = [b.add1("attention", [q, k, v], attrs)]
    return b.graph


def load_decode(tmp_path, graph, block_n: int, compute_units: int = 64):
    ctx = GenContext(graph, {"attention_decode": {"num_warps": 2, "num_stages": 1, "BLOCK_N": block_n}},
                     compute_units=compute_units)
    spec, red, const, c, _ = build_decode(ctx, graph.nodes[-1])
    path = tmp_path / f"{spec.name}.py"
    path.write_text(spec.source)
    mspec = importlib.util.spec_from_file_location(spec.name, path)
    mod = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(mod)
    return getattr(mod, spec.fn), getattr(mod, red.fn), const, c


def paged(lens: list[int], hkv: int, d: int, page: int, dtype, gen):
    """Caches with the sequences' blocks shuffled over the pool, their block tables and the dense K/V per sequence."""
    per = [max(1, -(-n // page)) for n in lens]
    width = max(per)
    pool = sum(per) + 3
    k_cache = torch.randn(pool, page, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(pool, page, hkv, d, generator=gen).to(dtype)
    order = torch.randperm(pool, generator=gen)
    bt = torch.zeros(len(lens), width, dtype=torch.int32)
    dense, at = [], 0
    for i, (n, p) in enumerate(zip(lens, per)):
        blocks = order[at:at + p]
        at += p
        bt[i, :p] = blocks.to(torch.int32)
        kd = k_cache[blocks].reshape(p * page, hkv, d)[:n]
        vd = v_cache[blocks].reshape(p * page, hkv, d)[:n]
        dense.append((kd, vd))
    return k_cache, v_cache, bt, dense


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int, softcap: float):
    """One decode query [HQ, D] over k/v [n, HKV, D]: SDPA in fp32 (explicit softmax where softcap applies)."""
    n, hq = k.shape[0], q.shape[0]
    if n == 0:
        return torch.zeros_like(q, dtype=torch.float32)
    qf, kf, vf = q.float()[:, None], k.float().transpose(0, 1), v.float().transpose(0, 1)  # [H, 1, D], [HKV, n, D]
    allowed = torch.ones(1, n, dtype=torch.bool)
    if window:
        allowed[0, : max(0, n - window)] = False  # the new token is position n - 1: keys within the window
    if softcap:
        group = hq // k.shape[1]
        kf, vf = kf.repeat_interleave(group, 0), vf.repeat_interleave(group, 0)
        s = softcap * torch.tanh(qf @ kf.transpose(1, 2) * scale / softcap)
        return torch.softmax(s.masked_fill(~allowed, -math.inf), -1).matmul(vf)[:, 0]
    return F.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed, scale=scale, enable_gqa=True)[:, 0]


CASES = {  # hq, hkv, lens, page, BLOCK_N, splits, window, softcap, dtype, prefills before the decodes
    "mha_b1_one_split": (4, 4, [37], 16, 32, 1, 0, 0.0, "float32", 0),
    "gqa2_b3_long_one_3_splits": (4, 2, [1, 50, 203], 16, 64, 3, 0, 0.0, "float32", 0),
    "gqa4_padding_seq_max_splits": (8, 2, [0, 33, 17], 16, 16, 16, 0, 0.0, "float32", 0),
    "gqa2_b64_after_prefills": (4, 2, [(7 * i) % 61 + 1 for i in range(64)], 16, 32, 2, 0, 0.0, "float32", 2),
    "page128_tile_inside_page": (4, 2, [130, 5, 300], 128, 32, 2, 0, 0.0, "float32", 0),
    "page128_one_split_empty": (4, 1, [257, 1, 0], 128, 128, 1, 0, 0.0, "float32", 0),
    "window_splits_left_empty": (4, 2, [100, 10, 64], 16, 32, 4, 24, 0.0, "float32", 0),
    "softcap_two_splits": (4, 2, [45, 90], 16, 16, 2, 0, 5.0, "float32", 0),
    "window_softcap_one_split": (4, 2, [70, 3], 16, 32, 1, 20, 5.0, "float32", 0),
    "fp16_gqa2_three_splits": (4, 2, [77, 16, 160], 16, 64, 3, 0, 0.0, "float16", 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_decode_kernel_matches_sdpa(tmp_path, name):
    hq, hkv, lens, page, block_n, splits, window, softcap, dtype, prefills = CASES[name]
    d = 32
    dt = TORCH_DTYPE[dtype]
    gen = torch.Generator().manual_seed(len(name))
    dec, red, const, c = load_decode(tmp_path, attention_graph(hq, hkv, d, dtype, window, softcap), block_n)
    assert const["BLOCK_N"] == block_n and splits <= const["MAX_SPLITS"]
    # the step's stream: `prefills` sequences of a few tokens each (not this kernel's), then one token per decode
    all_lens = [5] * prefills + lens
    k_cache, v_cache, bt, dense = paged(all_lens, hkv, d, page, dt, gen)
    q_lens = [3] * prefills + [1] * len(lens)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    T = int(qsl[-1])  # noqa: N806
    q = (torch.randn(T, hq, d, generator=gen) * (3.0 if softcap else 1.0)).to(dt)
    out = torch.full((T, hq, d), float("nan"), dtype=dt)
    rows = len(lens) * hq * const["MAX_SPLITS"]
    part_out = torch.full((rows * const["BLOCK_D"],), float("nan"))  # stale scratch: never read past the splits
    part_max, part_sum = torch.full((rows,), float("nan")), torch.full((rows,), float("nan"))
    seq_lens = torch.tensor(all_lens, dtype=torch.int32)
    dec[(len(lens), hkv, splits)](q, k_cache, v_cache, bt, seq_lens, qsl, part_out, part_max, part_sum, out,
                                  prefills, bt.stride(0), splits, c["scale"],
                                  **{k: v for k, v in const.items() if k != "BLOCK_SIZE"}, BLOCK_SIZE=page,
                                  num_warps=2, num_stages=1)
    if splits > 1:
        red[(len(lens), hq)](part_out, part_max, part_sum, qsl, out, prefills, splits, HQ=hq, D=d,
                             BLOCK_D=const["BLOCK_D"], MAX_SPLITS=const["MAX_SPLITS"], num_warps=2)
    tol = 5e-3 if dtype == "float16" else 2e-5
    for i, n in enumerate(lens):
        tok = int(qsl[prefills + i])
        want = reference(q[tok], *dense[prefills + i], c["scale"], window, softcap)
        torch.testing.assert_close(out[tok].float(), want, atol=tol, rtol=tol, msg=lambda m, i=i, n=n: f"seq {i} ({n} keys): {m}")
    assert torch.isnan(out[: int(qsl[prefills])].float()).all()  # the prefill rows are not this kernel's


def test_split_count_follows_the_batch_not_the_context():
    """The host picks splits from the batch size alone: all MAX_SPLITS at batch 1, fewer as sequences x KV heads
    fill the device, 1 (no reduce) once they cover two waves; the host expression says the same."""
    hkv, cu = 8, 132
    most = num_splits(SimpleNamespace(compute_units=cu), hkv)
    assert most == 16
    picks = [decode_splits(b, hkv, cu, most) for b in range(1, 300)]
    assert picks[0] == most and picks[63] == 1 and 1 < picks[15] < most
    assert all(a >= b for a, b in zip(picks, picks[1:]))
    assert all(b * hkv * p >= 2 * cu or p == most for b, p in zip(range(1, 300), picks))  # they fill two waves
    expr = splits_expr(hkv, cu, most)
    assert [eval(expr, {}, {"st": SimpleNamespace(num_decodes=b)}) for b in range(1, 300)] == picks  # noqa: S307


def test_generated_program_decodes_at_one_and_several_splits(tmp_path):
    """The host program's own launches (cache write, decode kernel, reduce only where splits > 1) against SDPA:
    at compute_units 4 and 2 KV heads batch 1 runs 2 splits and batch 4 one split (no reduce)."""
    from portlayer.backends.generate import context_for, lower_group, lower_views
    from portlayer.codegen.host import generate_program
    from portlayer.codegen.host_support import StepState
    from portlayer.codegen.program import load_program, write_program
    from portlayer.flatten.op_defs.attention import AttentionMetadata
    from portlayer.passes.pipeline import run_pipeline

    hq, hkv, d, page = 4, 2, 32, 16
    r = run_pipeline(attention_graph(hq, hkv, d, "float32"), "nvidia-h200")
    ctx = context_for(r.graph, r.plan, r.descriptor)
    ctx.compute_units = 4  # a small device: batch 1 splits, batch 4 does not
    ctx.launch["attention_decode"] = {**ctx.launch["attention_decode"], "BLOCK_N": 32}
    write_program(generate_program(r.graph, ctx, lower_group, lower_views, family="triton", target="nvidia-h200"),
                  tmp_path / "p")
    prog = load_program(tmp_path / "p", r.graph.weights, "cpu", max_tokens=64, max_seqs=8)
    assert "if attn_splits > 1:" in (tmp_path / "p" / "host.py").read_text()  # the reduce is conditional
    gen = torch.Generator().manual_seed(3)
    for batch, want_splits in ((1, 2), (4, 1)):
        assert decode_splits(batch, hkv, 4, 2) == want_splits
        lens = [40 + 17 * i for i in range(batch)]  # cached tokens; this step adds one to each
        k_cache, v_cache, bt, _ = paged([n + 1 for n in lens], hkv, d, page, torch.float32, gen)
        slots = torch.tensor([int(bt[i, n // page]) * page + n % page for i, n in enumerate(lens)])
        meta = AttentionMetadata(torch.arange(batch + 1, dtype=torch.int32), torch.tensor([n + 1 for n in lens],
                                 dtype=torch.int32), slots, bt, 0, 1, max(lens) + 1)
        feeds = {x: torch.randn(batch, h, d, generator=gen) for x, h in (("q", hq), ("k", hkv), ("v", hkv))}
        caches = [(k_cache, v_cache)]
        st = StepState.build(meta, batch, torch.device("cpu"), caches)
        (out,) = prog.forward(batch, batch, feeds, st, caches)
        for i, n in enumerate(lens):
            blocks = bt[i, : n // page + 1].long()
            kd = k_cache[blocks].reshape(-1, hkv, d)[: n + 1]
            vd = v_cache[blocks].reshape(-1, hkv, d)[: n + 1]
            torch.testing.assert_close(kd[n], feeds["k"][i])  # the new token's K went into the cache first
            torch.testing.assert_close(out[i].float(), reference(feeds["q"][i], kd, vd, 1 / math.sqrt(d), 0, 0.0),
                                       atol=2e-5, rtol=2e-5)
