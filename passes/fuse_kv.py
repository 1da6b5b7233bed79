"""Which rope kernel writes an attention's new K/V into the paged cache (issue 12: one launch less
per layer). The attention group's lowering writes them itself (reshape_and_cache) unless the
kernel that makes its K — a q/k rope kernel whose implementation has the ``kv_write`` trait —
takes the write over: the rope program of a token holds its rotated K heads in registers anyway
and stores them straight at slot_mapping[t], with V (read from memory, made by an earlier kernel).
Recorded on both kernel records (``kv_write`` / ``kv_written_by``) so both lowerings realise the
same decision; graphs without rope (or with a view between rope and attention) keep the write in
the attention group.
"""

from __future__ import annotations

from typing import Any

from portlayer.backends.impls import find
from portlayer.flatten.ir import Graph, Node


def _trait(n: Node, key: str) -> bool:
    impl = find(n.meta.get("impl", ""), n.op)
    return bool(impl is not None and impl.trait(key))


def assign_kv_writes(g: Graph, kernels: list[dict[str, Any]]) -> dict[str, str]:
    """Mark each (rope kernel, attention kernel) pair; returns attention -> why not, for the others."""
    nodes = {n.name: n for n in g.nodes}
    prod = g.producers()
    kernel_of = {m: k for k in kernels for m in k["nodes"]}
    index = {k["name"]: i for i, k in enumerate(kernels)}
    refused: dict[str, str] = {}
    for k in kernels:
        att = nodes.get(k["anchor"])
        if k["family"] != "attention" or att is None or att.op != "attention" or len(att.inputs) < 3:
            continue
        if not _trait(att, "kv_from_rope"):
            refused[att.name] = f"{att.meta.get('impl')} writes its K/V itself"
            continue
        p = prod.get(att.inputs[1])
        rk = kernel_of.get(p.name) if p is not None else None
        if p is None or p.op != "rope" or rk is None:
            refused[att.name] = "its K is not a rope's output (no rope, or a view between)"
            continue
        ropes = [nodes[m] for m in rk["nodes"] if nodes[m].op == "rope"]
        if len(ropes) != 2 or ropes[-1] is not p or not _trait(p, "kv_write") or "kv_write" in rk:
            refused[att.name] = f"{rk['name']} is not a q/k rope kernel that can store K/V"
            continue
        vp = prod.get(att.inputs[2])
        if vp is not None and index[kernel_of[vp.name]["name"]] >= index[rk["name"]]:
            refused[att.name] = f"V is made after {rk['name']}"
            continue
        rk["kv_write"] = {"attention": att.name, "v": att.inputs[2], "layer": int(att.attrs.get("layer", 0))}
        k["kv_written_by"] = rk["name"]
    return refused
