"""Interpreter tier: the fused MoE kernels (codegen/kernels/moe.py) against the moe_experts
reference op, over top-k 1, 2 and 8, 4 to 64 experts, ragged token counts (including tokens
that leave experts empty), float32 and float16; and the descriptor-driven tile choice."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from triton_harness import rel_err, tol, use_interpreter

from portlayer.codegen.kernels.moe import build_fused_moe, fused_moe, moe_align, moe_config
from portlayer.flatten.ops import get_op

pytestmark = pytest.mark.interpreter

CASES = [  # tokens, experts, top_k, hidden, inter, dtype
    (1, 4, 1, 32, 16, torch.float32),
    (7, 8, 2, 32, 48, torch.float32),
    (17, 64, 8, 32, 16, torch.float32),
    (19, 16, 2, 64, 32, torch.float16),  # bf16: the interpreter has no bf16 (checked on the GPU tier)
]


def _load(spec, tmp_path):
    path = tmp_path / f"{spec.name}.py"
    path.write_text(spec.source)
    mod_spec = importlib.util.spec_from_file_location(spec.name, path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return getattr(mod, spec.fn)


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, dtype", CASES)
def test_fused_moe_matches_reference(monkeypatch, tmp_path, tokens, experts, top_k, hidden, inter, dtype):
    use_interpreter(monkeypatch)
    gen = torch.Generator().manual_seed(tokens * 131 + experts)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    cfg = moe_config(16 * 1024, 32, str(dtype).removeprefix("torch."), hidden, inter)
    specs = build_fused_moe(str(dtype).removeprefix("torch."), "silu", cfg, top_k, hidden, inter)
    kernels = tuple(_load(s, tmp_path) for s in specs)
    got = fused_moe(kernels, cfg, x, ids, weights, w_gate_up, w_down)
    want = get_op("moe_experts").reference([x, ids, weights, w_gate_up, w_down], {
        "num_experts": experts, "top_k": top_k, "intermediate_size": inter, "activation": "silu"})[0]
    assert got.dtype == dtype and got.shape == want.shape
    assert rel_err(got, want) <= tol(dtype), (tokens, experts, top_k)


def test_align_groups_slots_by_expert():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    sorted_ids, expert_ids, num_padded = moe_align(ids, 4, 16)
    assert int(num_padded) == 48  # experts 0, 1, 3 each padded to one block of 16
    blocks = sorted_ids.view(-1, 16)
    for b in range(3):
        slots = [int(s) for s in blocks[b] if s < 6]
        assert all(int(ids.reshape(-1)[s]) == int(expert_ids[b]) for s in slots)
    assert sorted(int(s) for s in sorted_ids if s < 6) == list(range(6))


def test_tiles_follow_shared_memory_and_warp_width():
    big = moe_config(228 * 1024, 32, "bfloat16", 4096, 1536)  # H200
    small = moe_config(32 * 1024, 64, "bfloat16", 4096, 1536)
    assert (big.block_m, big.block_n) > (small.block_m, small.block_n)
    assert big.num_warps == 4 and small.num_warps == 2
    assert "shared memory" in big.reason
