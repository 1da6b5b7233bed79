"""Sustained memory bandwidth at several working-set sizes, and where the cache stops helping.

A decode step reads every weight once; whether those bytes come from a cache or from DRAM/HBM
decides its time. The sweep times a read (a sum: bytes read / time) and a copy (read + write
bytes / time, like STREAM copy) from a cache-sized buffer up to one far larger than any cache.
"""

from __future__ import annotations

from typing import Any

import torch

from portlayer.capabilities.calibrate_timing import Progress, Sizes, measure_s, sig


def sweep_sizes(largest: int) -> list[int]:
    """4 KiB (a tiny op: what per-op overhead costs), x4 each step, up to ``largest`` bytes (always included)."""
    out, s = [], 4 * 2**10
    while s < largest:
        out.append(s)
        s *= 4
    return out + [largest]


def _bandwidth(n_bytes: int, device: torch.device, sizes: Sizes) -> tuple[float, float]:
    n = max(1, n_bytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    out = torch.empty((), dtype=torch.float32, device=device)
    cap = max(sizes.iters, int(sizes.iters * sizes.copy_bytes / max(n_bytes, 1)))
    read = lambda: torch.sum(src, dim=0, out=out)  # noqa: E731
    copy = lambda: dst.copy_(src)  # noqa: E731
    if device.type == "cuda":
        cap = min(cap, 200)  # a captured graph holds every call
    else:
        cap = 1 << 20  # the time budget decides
    t_read = measure_s(read, device, sizes, sizes.budget_s, cap, graphed=True)
    t_copy = measure_s(copy, device, sizes, sizes.budget_s, cap, graphed=True)
    return 4 * n / t_read / 1e9, 2 * 4 * n / t_copy / 1e9


def measure_bandwidth_sweep(device: torch.device, sizes: Sizes, progress: Progress) -> list[dict[str, Any]]:
    """[{bytes, read_gbps, copy_gbps}] from small to large working sets."""
    rows = []
    for n in sweep_sizes(sizes.copy_bytes):
        progress.start(f"bandwidth {n / 2**10:g} KiB" if n < 2**20 else f"bandwidth {n / 2**20:g} MiB")
        read, copy = _bandwidth(n, device, sizes)
        rows.append({"bytes": n, "read_gbps": sig(read), "copy_gbps": sig(copy)})
        progress.done(f"read {read:.4g} GB/s, copy {copy:.4g} GB/s")
    return rows


def cache_knee(rows: list[dict[str, Any]]) -> int | None:
    """Largest working set still read at least 1.5x faster than the largest one (None: no knee seen)."""
    if len(rows) < 2:
        return None
    floor = rows[-1]["read_gbps"]
    fast = [r["bytes"] for r in rows[:-1] if r["read_gbps"] >= 1.5 * floor]
    return max(fast) if fast else None


def measure_copy_bandwidth(device: torch.device, sizes: Sizes) -> float:
    """GB/s of a device-to-device copy of ``sizes.copy_bytes`` (read + write bytes / time)."""
    return _bandwidth(sizes.copy_bytes, device, sizes)[1]
