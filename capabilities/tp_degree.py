"""The tensor-parallel degree: which N a model splits over, and the smallest N that fits a device.

A degree must split the attention heads evenly, and the KV heads either evenly or by whole
replication (fewer KV heads than ranks: each rank keeps one, as vLLM does). ``auto`` picks the
smallest such N (up to 64) whose per-rank share of the weights plus one full-length sequence of
KV cache fits the device's usable memory; every number comes from the model and the descriptor.
"""

from __future__ import annotations

from portlayer.capabilities.descriptor import Descriptor
from portlayer.capabilities.plan import PlanError
from portlayer.capabilities.requirements import ModelRequirements

MAX_DEGREE = 64


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def divides(req: ModelRequirements, n: int) -> str | None:
    """None if ``n`` ranks can split the model; else why not."""
    heads, kv = req.num_heads, req.num_kv_heads
    if heads and heads % n:
        return f"{heads} attention heads do not split over {n} ranks"
    if kv and kv % n and n % kv:
        return f"{kv} KV heads neither split over nor replicate evenly onto {n} ranks"
    return None


def kv_heads_per_rank(req: ModelRequirements, n: int) -> int:
    kv = max(1, req.num_kv_heads)
    return kv // n if kv % n == 0 else 1


def check_degree(req: ModelRequirements, desc: Descriptor, n: int) -> int:
    if n < 1:
        raise PlanError(f"--tensor-parallel {n}: the degree must be a positive number of ranks (or auto)")
    why = divides(req, n)
    if why:
        ok = [str(k) for k in range(1, MAX_DEGREE + 1) if not divides(req, k)]
        raise PlanError(f"--tensor-parallel {n} for {req.name}: {why}; degrees that work: {', '.join(ok[:8])}")
    if n > 1 and not desc.raw.get("collectives"):
        raise PlanError(f"--tensor-parallel {n}: descriptor {desc.name} ({desc.origin}) names no collectives library; "
                        "add \"collectives\": {\"library\": ..., \"torch_backend\": ...}")
    return n


def per_rank_bytes(req: ModelRequirements, dtype: str, n: int) -> tuple[int, int]:
    """(weights, KV of one full-length sequence) that one of ``n`` ranks holds."""
    weights = req.param_bytes_at(dtype) // n
    kv_tok = req.kv_bytes_per_token_at(dtype) * kv_heads_per_rank(req, n) // max(1, req.num_kv_heads)
    return weights, (kv_tok * req.max_positions if req.needs_kv_cache else 0)


def auto_degree(req: ModelRequirements, desc: Descriptor, dtype: str, usable_fraction: float) -> tuple[int, str]:
    usable = desc.memory.capacity_bytes * usable_fraction
    tried = []
    for n in range(1, MAX_DEGREE + 1):
        if divides(req, n):
            continue
        w, kv = per_rank_bytes(req, dtype, n)
        if w + kv <= usable:
            head = f"auto: {n} rank(s): per rank {_gib(w)} of {dtype} weights + {_gib(kv)} KV for one {req.max_positions}-token sequence fit {_gib(usable)} usable of {desc.name}"
            return (check_degree(req, desc, n) if n > 1 else 1), head + (f" ({'; '.join(tried)} did not)" if tried else "")
        tried.append(f"N={n}: {_gib(w + kv)}")
    raise PlanError(f"--tensor-parallel auto: {req.name} does not fit {desc.name} at any degree up to {MAX_DEGREE} "
                    f"({'; '.join(tried[-3:])} per rank vs {_gib(usable)} usable); quantize or pick a larger device")
