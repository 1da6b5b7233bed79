"""The fused MoE kernels (templates/triton/fused_moe.py.j2): builder, launch config, host side.

``moe_experts`` runs as vLLM's fused_moe does: the host sorts the (token, choice) slots by
expert and pads each expert's run to BLOCK_M (``moe_align``, torch ops on the device, no host
sync: the padded count stays a device tensor); stage 1 is a grouped GEMM over the sorted
slots with the gate and up halves and the activation fused; stage 2 is the down GEMM with
the routing weight fused; the host sums each token's TOP_K slots in a fixed order.

The tile sizes come from the device descriptor (``moe_config``): the largest tile whose
pipelined stage footprint fits the shared memory per compute unit, warps scaled to the
warp/wavefront width. Registration in the implementation registry is the lead's (see the
brief): this module is standalone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from portlayer.codegen.kernels.context import dot_args, make_kernel
from portlayer.codegen.spec import KernelSpec, Param, pow2, ptr, short_dtype
from portlayer.flatten.ir import dtype_itemsize

TEMPLATE = "triton/fused_moe.py.j2"
_TILES = [(64, 128, 64), (64, 64, 64), (32, 64, 64), (16, 64, 64), (16, 32, 32), (16, 16, 16)]


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    reason: str = ""


def moe_config(shared_mem_bytes: int, warp_size: int, dtype: str, hidden: int, inter: int,
               num_stages: int = 2) -> MoeConfig:
    """Largest (BLOCK_M, BLOCK_N, BLOCK_K) whose stage-1 footprint (A tile + gate and up
    tiles, ``num_stages`` deep) fits ``shared_mem_bytes``; 128 threads per program."""
    item = dtype_itemsize(dtype)
    cap_n, cap_k = max(16, pow2(max(hidden, inter))), max(16, pow2(hidden))
    for bm, bn, bk in _TILES:
        bn, bk = min(bn, cap_n), min(bk, cap_k)
        need = num_stages * (bm * bk + 2 * bk * bn) * item
        if need <= shared_mem_bytes:
            warps = max(1, 128 // max(1, warp_size))
            return MoeConfig(bm, bn, bk, warps, num_stages,
                             f"tile {bm}x{bn}x{bk} x{num_stages} stages = {need} B of {shared_mem_bytes} B shared memory; "
                             f"{warps} warps of {warp_size}")
    return MoeConfig(16, 16, 16, max(1, 128 // max(1, warp_size)), 1, "smallest tile: shared memory is tiny")


def build_fused_moe(dtype: str, activation: str, cfg: MoeConfig, top_k: int, hidden: int,
                    inter: int) -> tuple[KernelSpec, KernelSpec]:
    """The two stage kernels for one (dtype, activation, shape, tile) combination."""
    specs = []
    for stage, n, k in (("gate_up", inter, hidden), ("down", hidden, inter)):
        params = [Param("a_ptr", ptr(dtype)), Param("w_ptr", ptr(dtype))]
        if stage == "down":
            params.append(Param("topk_weights_ptr", "*fp32"))
        params += [Param("out_ptr", ptr(dtype)), Param("sorted_ids_ptr", "*i32"), Param("expert_ids_ptr", "*i32"),
                   Param("num_padded_ptr", "*i32"), Param("NUM_SLOTS", "i32")]
        const = {"TOP_K": int(top_k), "N": int(n), "K": int(k), "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                 "BLOCK_K": cfg.block_k}
        params += [Param(c, "constexpr") for c in const]
        specs.append(make_kernel(TEMPLATE, "fused_moe", f"{stage}_{activation}_{short_dtype(dtype)}", params, const,
                                 cfg.num_warps, cfg.num_stages, stage=stage, activation=activation,
                                 dot_args=dot_args(dtype), doc=f"Fused MoE, {stage.replace('_', ' + ')} stage."))
    return specs[0], specs[1]


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids int32 [max_padded], expert_ids int32 [max_blocks], num_padded int32 [1]).

    Sizes depend only on (slots, experts, BLOCK_M), never on the routing, so buffers can be
    planned once; slots of one expert keep their original order (stable sort)."""
    flat = topk_ids.reshape(-1).long()
    slots = flat.numel()
    dev = flat.device
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    chosen = flat[order]
    first = torch.cumsum(counts, 0) - counts
    pos = starts[chosen] + torch.arange(slots, device=dev) - first[chosen]
    max_padded = slots + num_experts * (block_m - 1)
    max_padded = (max_padded + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((max_padded,), slots, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    block_start = torch.arange(0, max_padded, block_m, device=dev)
    expert_ids = (torch.searchsorted(torch.cumsum(padded, 0), block_start, right=True)).clamp_max(num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), padded.sum().to(torch.int32).reshape(1)


def fused_moe(kernels: tuple[Any, Any], cfg: MoeConfig, x: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Launch the two stages (``kernels``: the loaded @triton.jit functions) for moe_experts."""
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w_gate_up.shape[0], w_down.shape[2]
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, num_experts, cfg.block_m)
    slots = t * top_k
    inter_buf = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(slots, hidden, dtype=x.dtype, device=x.device)
    blocks = sorted_ids.numel() // cfg.block_m
    gate_up, down = kernels
    common = dict(TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    gate_up[(blocks * triton_cdiv(inter, cfg.block_n),)](
        x.contiguous(), w_gate_up.contiguous(), inter_buf, sorted_ids, expert_ids, num_padded, slots,
        N=inter, K=hidden, **common)
    down[(blocks * triton_cdiv(hidden, cfg.block_n),)](
        inter_buf, w_down.contiguous(), topk_weights.reshape(-1).float().contiguous(), out, sorted_ids, expert_ids,
        num_padded, slots, N=hidden, K=inter, **common)
    return out.view(t, top_k, hidden).float().sum(dim=1).to(x.dtype)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
