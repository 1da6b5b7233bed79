"""Activation buffers of the host program: one arena, offsets planned once.

Every activation the kernels write is ``[num_tokens, ...]``, so its size is a number of
bytes per token. Offsets are planned in bytes per token by first fit over group lifetimes
(views extend the life of the buffer they alias); at load time offset = k * max_tokens, so
one arena of (peak bytes per token x max_tokens) serves every token count without
re-planning. When the memory-plan pass has written ``graph.meta["memory_plan"]`` and it
covers every buffer, its offsets are used instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from portlayer.codegen.kernels.context import host_dim
from portlayer.flatten.ir import TensorType, dtype_itemsize

ALIGN = 256  # bytes per token are rounded to this, so every offset is 256-byte aligned


@dataclass
class Buffer:
    value: str
    dtype: str
    shape: list[str]  # host expressions in T
    per_token: int  # bytes per token
    offset: str  # host expression in T (evaluated with T = max_tokens)


def in_arena(t: TensorType, token_symbol: str = "num_tokens") -> bool:
    """Arena buffers are [num_tokens, static...]; others (e.g. [num_seqs, vocab]) are allocated per step."""
    return bool(t.shape) and t.shape[0] == token_symbol and all(isinstance(d, int) for d in t.shape[1:])


def plan_buffers(types: dict[str, TensorType], written: list[list[str]], reads: list[list[str]],
                 aliases: dict[str, str], outputs: list[str], memory_plan: dict[str, Any] | None = None,
                 token_symbol: str = "num_tokens") -> tuple[list[Buffer], str]:
    """Arena buffers for the values each group writes; returns them and the arena size expression."""
    life: dict[str, list[int]] = {}
    for gi, vals in enumerate(written):
        for v in vals:
            if in_arena(types[v], token_symbol):
                life.setdefault(v, [gi, gi])
    for gi, vals in enumerate(reads):
        for v in vals:
            root = aliases.get(v, v)
            if root in life:
                life[root][1] = max(life[root][1], gi)
    for o in outputs:
        root = aliases.get(o, o)
        if root in life:
            life[root][1] = len(written)
    bufs: list[Buffer] = []
    placed: list[tuple[int, int, int, int]] = []  # start, end, lo, hi (bytes per token)
    for v, (start, end) in life.items():
        t = types[v]
        if not t.shape or t.shape[0] != token_symbol or any(not isinstance(d, int) for d in t.shape[1:]):
            raise ValueError(f"buffer {v} {t} is not [num_tokens, static...]")
        per = dtype_itemsize(t.dtype)
        for d in t.shape[1:]:
            per *= int(d)
        size = -(-per // ALIGN) * ALIGN
        lo = 0
        for s, e, a, b in sorted(placed, key=lambda p: p[2]):
            if s <= end and start <= e and a < lo + size and lo < b:
                lo = -(-b // ALIGN) * ALIGN
        placed.append((start, end, lo, lo + size))
        bufs.append(Buffer(v, t.dtype, [host_dim(d) for d in t.shape], per, f"{lo} * T"))
    peak = max((p[3] for p in placed), default=0)
    arena = f"{peak} * T"
    if memory_plan and all(b.value in memory_plan.get("buffers", {}) for b in bufs):
        mp = memory_plan["buffers"]
        for b in bufs:
            b.offset = host_dim(mp[b.value]["offset"])
        arena = host_dim(memory_plan.get("arena_bytes", arena))
    return bufs, arena
