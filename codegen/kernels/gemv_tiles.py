"""Tiles and row tiers of the few-rows GEMMs (gemv*.py.j2): which kernels run at which rows, and their tiles.

Two tiers (codegen/gemm_rule.py): up to ``tuning.gemv_max_tokens`` rows the CUDA-core product, up to
``tuning.gemv_dot_max_tokens`` the same kernels with ``tl.dot`` (tensor cores; rows padded to 16, 16 columns a
program). The host picks (BLOCK_M, BLOCK_K) per step (host_support.gemv_blocks); every pick a tier can make is
listed so GPU artifacts ship a binary for each.
"""

from __future__ import annotations

from dataclasses import dataclass

from portlayer.codegen.host_support import gemv_block_choices
from portlayer.codegen.kernels.context import GenContext
from portlayer.codegen.lowering import Unlowerable
from portlayer.codegen.spec import TL_DTYPE, pow2


def few_rows_tiers(ctx: GenContext) -> list[tuple[int, bool]]:
    """(row limit, tensor cores) of each few-rows tier the context generates, in row order: the CUDA-core
    kernels up to gemv_max_tokens, then the tensor-core tier up to gemv_dot_max_tokens (gemm_rule)."""
    tiers = [(ctx.gemv_max_tokens, False)] if ctx.gemv_max_tokens > 0 else []
    if ctx.gemv_dot_max_tokens > ctx.gemv_max_tokens:
        tiers.append((ctx.gemv_dot_max_tokens, True))
    return tiers


def few_rows_choices(ctx: GenContext, block_k: int, least: int, dot: bool) -> list[dict[str, int]]:
    """Every (BLOCK_M, BLOCK_K) the host can pick for a tier's rows (one AOT binary each)."""
    if dot:
        return gemv_block_choices(ctx.gemv_dot_max_tokens, block_k, least, min_rows=ctx.gemv_max_tokens + 1,
                                  tensor_cores=True)
    return gemv_block_choices(ctx.gemv_max_tokens, block_k, least)


def dot_dtype(x_dtype: str, w_dtype: str | None) -> str:
    """The tl dtype the tensor-core tier multiplies in: the activation's when the weight has it (or is
    quantized: linear_wq dequantizes into x's dtype), else float32 (no operand is rounded below its dtype)."""
    return TL_DTYPE[x_dtype] if w_dtype in (None, x_dtype) else "tl.float32"


def tier_why(dot: bool, fused: str = "") -> str:
    """The host program's comment on a few-rows branch."""
    return ("gemm_rule: a few rows read the weights once, " + fused
            + ("on the tensor cores (tuning.gemv_dot_max_tokens)" if dot else "on the CUDA cores"))


def gemv_tiles(cfg: dict[str, int], n: int, k: int, group: int = 32, dot: bool = False) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K at one row) of the few-rows kernel, from the Plan's launch.gemv config:
    enough column blocks to give every compute unit ``PROGRAMS // CUs`` programs, and a W tile of
    at most ``TILE`` elements whose K side divides K where it can (no half-empty last tile).
    ``dot`` (the tensor-core tier): 16 columns a program, tl.dot's smallest tile side."""
    bn = 16 if dot else 2
    while bn < 16 and n // (bn * 2) >= cfg["PROGRAMS"]:
        bn *= 2
    cap = max(group, cfg["TILE"] // bn)
    bk = group
    while bk * 2 <= cap and k % (bk * 2) == 0:
        bk *= 2
    if k % bk:  # K has no power-of-two divisor >= 32: masked tiles of the register budget's width
        bk = group
        while bk * 2 <= min(cap, pow2(k)):
            bk *= 2
    return bn, bk


#: Two forms of the quantized CUDA-core GEMV, measured on the H200 in the Qwen3-0.6B int4 decode step (torch.profiler,
#: docs/performance.md session 15): without a norm prologue, many narrow programs with unrolled sub-group tiles
#: (sub_group_tiles) read o_proj / down_proj in 3.8 us against 7.3 us for whole-K tiles; with the norm fused, the
#: same narrow programs each recompute the row's norm (4x the programs: 12.1 / 13.9 us against 6.9 / 9.3 us for
#: the whole-K form, whole_k_tiles, for add + norm + Q|K|V and add + norm + gate|up + SiLU*mul).


@dataclass(frozen=True)
class QuantTiles:
    """The quantized CUDA-core tier's tiles: BLOCK_N columns a program, K tiles of BLOCK_K (at one row) read as
    BLOCK_K // SUB sub-groups of SUB columns (a power of two dividing the group: one scale each, broadcast), and
    UNROLL tiles unrolled per loop step. ``least``: the narrowest K tile gemv_blocks may pick as rows grow."""

    bn: int
    bk: int
    sub: int
    unroll: int

    @property
    def least(self) -> int:
        return self.sub

    @property
    def const(self) -> dict[str, int]:
        return {"SUB": self.sub, "UNROLL": self.unroll}


def sub_group_tiles(cfg: dict[str, int], k: int, group: int, parts: int = 1) -> QuantTiles:
    """The tiles of a quantized few-rows kernel without a norm prologue, from the Plan's launch.gemv_wq config
    (``parts``: weights each program reads side by side share its BLOCK_N). Any group linear_wq's lowering takes
    (multiples of 16 / 32, per channel) has a power-of-two sub-group: SUB is the largest dividing it, at most
    BLOCK_K. BLOCK_K and BLOCK_N are taken down to powers of two (a tile of 96 would skip the columns between its
    64-wide sub-group and the next)."""
    block_k, block_n = floor_pow2(cfg["BLOCK_K"]), floor_pow2(max(1, cfg["BLOCK_N"] // parts))  # tl.arange sides
    sub = 1
    while group % (sub * 2) == 0 and sub * 2 <= block_k:
        sub *= 2
    bk = max(sub, min(block_k, pow2(k)))  # a power-of-two multiple of SUB: the tile is BLOCK_K // SUB sub-groups
    return QuantTiles(block_n, bk, sub, max(1, min(cfg["UNROLL"], -(-k // bk))))


def pdl_trigger(cfg: dict[str, int]) -> int:
    """launch.<family>'s PDL_TRIGGER under programmatic dependent launch: 1 lets the next kernel launch right after
    this one's wait (its programs then sit on the units, waiting), 2 only as this one's programs exit. Measured on the
    H200 (docs/performance.md, session 16): the sub-group GEMV's early trigger made the norm-fused kernel after it
    take 17.5 us instead of 8.3, and the int4 decode step 1.31 ms instead of 1.03."""
    v = int(cfg.get("PDL_TRIGGER", 1))
    if v not in (1, 2):
        raise Unlowerable(f"launch config {cfg}: PDL_TRIGGER is 1 (the next kernel launches after this one's wait) "
                         f"or 2 (as its programs exit), not {v}; fix the tuning file or override that set it")
    return v


def floor_pow2(n: int) -> int:
    """The largest power of two <= n (>= 1): a launch config from a file or an override may hold any int."""
    return 1 << max(0, int(n).bit_length() - 1)


def whole_k_tiles(cfg: dict[str, int], n: int, k: int, group: int, tile_parts: int = 1) -> tuple[int, int, bool, int]:
    """(BLOCK_N, BLOCK_K, in_group, least BLOCK_K) of a quantized few-rows kernel with a norm prologue, from the
    Plan's launch.gemv config: every program recomputes the norm of the whole row, so the programs are few and
    wide (as the float kernels'), the whole row in one K tile where it fits. The K tile lies inside one
    group (per channel, large or non-power-of-two groups: the largest power of two dividing the group) or
    holds whole power-of-two groups; ``least`` bounds the tile gemv_blocks narrows as rows grow.
    linear_wq's lowering takes groups that are multiples of 16 (int8) / 32 (int4), so a tile always exists."""
    cfg = {**cfg, "TILE": max(32, cfg["TILE"] // tile_parts)}
    bn, bk = gemv_tiles(cfg, n, k)
    if group % bk == 0:
        return bn, bk, True, min(32, bk)
    if pow2(group) == group:
        bn, bk = gemv_tiles(cfg, n, k, max(32, group))
        return bn, bk, bk <= group, min(bk, max(32, group))
    d = 1
    while group % (d * 2) == 0 and d * 2 <= bk:
        d *= 2
    return bn, d, True, d


def gemv_blocks_call(m: str, block_k: int, least: int, dot: bool) -> str:
    """The host line that picks a few-rows launch's (BLOCK_M, BLOCK_K) for the step's rows."""
    return (f"bm, bk = gemv_blocks({m}, {block_k}{f', {least}' if least != 32 else ''}"
            f"{', tensor_cores=True' if dot else ''})")
