"""The fused MoE kernels (templates/triton/fused_moe.py.j2): builder, launch config, host side.

``moe_experts`` runs as vLLM's fused_moe does: the host sorts the (token, choice) slots by
expert and pads each expert's run to BLOCK_M (``moe_align``, torch ops on the device, no host
sync: the padded count stays a device tensor); stage 1 is a grouped GEMM over the sorted
slots with the gate and up halves and the activation fused; stage 2 is the down GEMM with
the routing weight fused; the host sums each token's TOP_K slots in a fixed order.

The tile sizes come from the device descriptor (``moe_config``): the largest tile whose
pipelined stage footprint fits the shared memory per block, warps scaled to the
warp/wavefront width. :func:`lower_moe` is the lowering of ``triton.fused_moe``
(backends/impls_moe.py): the alignment statements are written into the host program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from portlayer.codegen.host_support import gemm_block_m_choices
from portlayer.codegen.kernels.context import GenContext, dot_args, make_kernel
from portlayer.codegen.lowering import GroupCode, KernelGroup
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
    planned once and a CUDA graph can replay it (no host sync: scatter_add, not bincount); slots
    of one expert keep their original order (stable sort). Ids outside [0, num_experts) go to a
    last bin past ``num_padded`` that no program reads (the reference: they contribute nothing).
    The generated host program runs the same statements (:func:`align_lines`)."""
    ns: dict[str, Any] = {"torch": torch, "ids": topk_ids}
    exec("\n".join(align_lines("ids", num_experts, block_m, str(topk_ids.numel()))), ns)  # our own text, no input
    return ns["moe_sorted"], ns["moe_blocks"], ns["moe_total"]


def align_lines(ids: str, num_experts: int, block_m: int | str, slots: str) -> list[str]:
    """Host statements sorting the ``slots`` (token, choice) pairs of ``ids`` by expert into
    ``block_m``-padded runs (an int or a host expression): moe_sorted (slot ids, sentinel
    ``slots``), moe_blocks (expert of each row block), moe_total (padded rows in use)."""
    e, bm = int(num_experts), str(block_m)
    return [
        f"moe_flat = {ids}.reshape(-1).long()",
        f"moe_flat = torch.where((moe_flat >= 0) & (moe_flat < {e}), moe_flat, {e})  # out of range: never computed",
        f"moe_counts = torch.zeros({e + 1}, dtype=torch.int64, device=moe_flat.device).scatter_add_("
        "0, moe_flat, torch.ones_like(moe_flat))",
        f"moe_padded = (moe_counts + ({bm} - 1)) // {bm} * {bm}",
        "moe_order = torch.argsort(moe_flat, stable=True)",
        "moe_chosen = moe_flat[moe_order]",
        "moe_pos = ((torch.cumsum(moe_padded, 0) - moe_padded)[moe_chosen] - (torch.cumsum(moe_counts, 0) - moe_counts)"
        "[moe_chosen] + torch.arange(moe_flat.numel(), device=moe_flat.device))",
        f"moe_sorted = torch.full(((({slots}) + {e + 1} * ({bm} - 1) + {bm} - 1) // {bm} * {bm},), {slots}, "
        "dtype=torch.int32, device=moe_flat.device)",
        "moe_sorted[moe_pos] = moe_order.to(torch.int32)",
        f"moe_blocks = torch.searchsorted(torch.cumsum(moe_padded[:{e}], 0), torch.arange(0, moe_sorted.numel(), {bm}, "
        f"device=moe_flat.device), right=True).clamp_max({e - 1}).to(torch.int32)",
        f"moe_total = moe_padded[:{e}].sum().to(torch.int32).reshape(1)",
    ]


def fused_moe(kernels: tuple[Any, Any], cfg: MoeConfig, x: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Launch the two stages (``kernels``: the loaded @triton.jit functions) for moe_experts,
    outside a host program (kernel tests, benchmarks); the same steps as :func:`lower_moe` emits."""
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w_gate_up.shape[0], w_down.shape[2]
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, num_experts, cfg.block_m)
    slots = t * top_k
    inter_buf = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    out = torch.zeros(slots, hidden, dtype=x.dtype, device=x.device)
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


def lower_moe(ctx: GenContext, group: KernelGroup) -> GroupCode:
    """The moe_experts group as host code: align the slots by expert (torch statements on the
    device), the two fused stages, the fixed-order sum of each token's TOP_K slots into the
    planned output. BLOCK_N / BLOCK_K and the largest BLOCK_M come from the descriptor's shared
    memory per block; BLOCK_M shrinks at run time to the rows an expert gets (16 at decode),
    so a batch-1 step does not pad every chosen expert to 64 rows."""
    (node,) = group.nodes
    x, ids, weights, w_gate_up, w_down = node.inputs
    out = node.outputs[0].name
    x_t, ids_t = ctx.types[x], ctx.types[ids]
    hidden, top_k = int(x_t.shape[1]), int(ids_t.shape[1])
    experts, inter = int(ctx.types[w_gate_up].shape[0]), int(ctx.types[w_down].shape[2])
    dtype, act = x_t.dtype, str(node.attrs.get("activation", "silu"))
    cfg = moe_config(ctx.shared_memory_bytes, ctx.warp_size, dtype, hidden, inter)
    gate_up, down = build_fused_moe(dtype, act, cfg, top_k, hidden, inter)
    gate_up.runtime_choices = down.runtime_choices = gemm_block_m_choices(cfg.block_m)  # moe_bm below
    slots = f"T * {top_k}" if top_k != 1 else "T"
    common = (f"TOP_K={top_k}, BLOCK_M=moe_bm, BLOCK_N={cfg.block_n}, BLOCK_K={cfg.block_k}, "
              f"num_warps={cfg.num_warps}, num_stages={cfg.num_stages}")
    grid = "moe_sorted.numel() // moe_bm"
    lines = [f"# moe_experts: {experts} experts, top-{top_k}, {hidden} -> 2x{inter} -> {hidden}; {cfg.reason}",
             f"moe_bm = gemm_block_m(-(-{slots} // {experts}), {cfg.block_m})  # rows per expert if routing were even",
             *align_lines(ids, experts, "moe_bm", slots),
             f"moe_inter = torch.empty({slots}, {inter}, dtype={x}.dtype, device={x}.device)",
             f"moe_out = torch.zeros({slots}, {hidden}, dtype={x}.dtype, device={x}.device)",
             f"K.{gate_up.name}[({grid} * {triton_cdiv(inter, cfg.block_n)},)](",
             f"    {x}.contiguous(), {w_gate_up}, moe_inter, moe_sorted, moe_blocks, moe_total, {slots}, N={inter}, "
             f"K={hidden}, {common})",
             f"K.{down.name}[({grid} * {triton_cdiv(hidden, cfg.block_n)},)](",
             f"    moe_inter, {w_down}, {weights}.reshape(-1).float().contiguous(), moe_out, moe_sorted, moe_blocks, "
             f"moe_total, {slots}, N={hidden}, K={inter}, {common})",
             f"{out}.copy_(moe_out.view(T, {top_k}, {hidden}).float().sum(dim=1))  # fixed order over the slots"]
    return GroupCode([gate_up, down], lines, [out])
