"""Interpreter tier: mla_attention's Triton lowering (codegen/kernels/mla.py: absorbed queries,
the latent cache read by the paged kernels as one KV head) against the op's reference, which
tests/test_mla.py checks against expanded SDPA: one paged step mixing a prefill chunk over cached
context with decodes, and the cache-free varlen path; the caches must end up equal."""

from __future__ import annotations

import pytest
import torch
from triton_harness import build_program, paged_setup, reference, rel_err, tol, use_interpreter

from portlayer.flatten.ir import GraphBuilder, TensorType

pytestmark = pytest.mark.interpreter
H, DN, DR, DV, R = 4, 16, 8, 12, 24


def _graph(dtype: torch.dtype, seed: int = 0):
    dt = str(dtype).removeprefix("torch.")
    g = torch.Generator().manual_seed(seed)
    b = GraphBuilder()
    q = b.add_input("q", TensorType(dt, ("num_tokens", H, DN + DR)))
    lat = b.add_input("latent", TensorType(dt, ("num_tokens", R)))
    pe = b.add_input("k_pe", TensorType(dt, ("num_tokens", DR)))
    w = b.add_param("w_kv_b", (torch.randn(H * (DN + DV), R, generator=g) / R**0.5).to(dtype))
    b.graph.outputs = [b.add1("mla_attention", [q, lat, pe, w], {
        "num_heads": H, "kv_lora_rank": R, "qk_nope_head_dim": DN, "qk_rope_head_dim": DR, "v_head_dim": DV,
        "scale": 0.2, "layer": 0})]
    return b.graph


def _feeds(t: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(t, H, DN + DR, generator=g).to(dtype), "latent": torch.randn(t, R, generator=g).to(dtype),
            "k_pe": torch.randn(t, DR, generator=g).to(dtype)}


@pytest.mark.parametrize("dtype,kv", [(torch.float32, None), (torch.float16, "float16"),
                                      (torch.float16, "float8_e4m3fn")], ids=["fp32", "fp16", "fp16-fp8cache"])
def test_paged_mla_matches_reference(monkeypatch, tmp_path, dtype, kv):
    use_interpreter(monkeypatch)
    graph = _graph(dtype)
    gen, prog = build_program(graph, tmp_path, kv_cache_dtype=kv)
    assert {r["impl"] for r in prog.result.graph.meta["kernels"]} >= {"triton.mla_attention"}
    meta, kc, _ = paged_setup([(9, 5), (20, 1), (3, 1)], 1, R + DR, dtype, seed=3)  # latent entries, one "head"
    kc = kc.to(prog.kv_dtype)
    vc = torch.zeros(*kc.shape[:3], 0, dtype=prog.kv_dtype)
    feeds = _feeds(int(meta.query_start_loc[-1]), dtype)
    ours_c, ref_c = [(kc.clone(), vc.clone())], [(kc.clone(), vc.clone())]
    (ours,) = prog.run(feeds, meta, ours_c)
    (want,) = reference(graph, feeds, meta, ref_c)
    assert ours.shape == want.shape == (7, H, DV)
    assert rel_err(ours, want) <= tol(dtype)
    assert torch.equal(ours_c[0][0].view(torch.uint8), ref_c[0][0].view(torch.uint8))  # the same bytes written


def test_mla_without_cache_matches_reference(monkeypatch, tmp_path):
    from portlayer.flatten.op_defs.attention import AttentionMetadata

    use_interpreter(monkeypatch)
    graph = _graph(torch.float32)
    _, prog = build_program(graph, tmp_path)
    meta = AttentionMetadata.from_lens([6, 1, 9])
    feeds = _feeds(16, torch.float32)
    (ours,) = prog.run(feeds, meta, None)
    (want,) = reference(graph, feeds, meta, None)
    assert rel_err(ours, want) <= tol(torch.float32)
