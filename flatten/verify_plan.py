"""Verifier rules for what the passes record in ``graph.meta``: kernel groups and the memory plan.

Codegen trusts both (it emits one launch per group and places buffers at the planned
offsets), and an artifact's graph.json is untrusted input, so the loader checks them too:
every node is in exactly one kernel group, groups name existing nodes and values, and the
memory plan's buffers are values of the graph with non-negative integer offsets and sizes
that stay non-negative and inside the arena. (Overlap of live buffers is proven separately
by passes/memory_check.py.)
"""

from __future__ import annotations

from typing import Any

from portlayer.flatten.ir import Graph

#: token counts at which symbolic buffer sizes are evaluated
SAMPLE_TOKENS = (1, 2, 7, 64)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _values(graph: Graph) -> set[str]:
    return {v.name for v in graph.inputs} | set(graph.params) | {v.name for n in graph.nodes for v in n.outputs}


def check_kernel_groups(graph: Graph, problems: list[str]) -> None:
    groups = graph.meta["kernels"]
    if not isinstance(groups, list):
        problems.append(f"meta.kernels must be a list of kernel groups, found {type(groups).__name__}")
        return
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    values = _values(graph)
    owner: dict[str, str] = {}
    names: set[str] = set()
    for gi, g in enumerate(groups):
        where = f"meta.kernels[{gi}]"
        if not isinstance(g, dict) or not isinstance(g.get("name"), str) or not isinstance(g.get("nodes"), list):
            problems.append(f"{where}: a kernel group is an object with a string 'name' and a 'nodes' list")
            continue
        where = f"kernel group {g['name']!r}"
        if g["name"] in names:
            problems.append(f"{where}: the group name is used by an earlier group")
        names.add(g["name"])
        if not g["nodes"]:
            problems.append(f"{where}: holds no nodes")
        idx = []
        for n in g["nodes"]:
            if not isinstance(n, str) or n not in order:
                problems.append(f"{where}: node {n!r} is not a node of the graph")
                continue
            if n in owner:
                problems.append(f"{where}: node {n!r} is already in kernel group {owner[n]!r} (each node runs once)")
            owner[n] = g["name"]
            idx.append(order[n])
        if idx != sorted(idx):
            problems.append(f"{where}: its nodes are not listed in execution order")
        for key in ("inputs", "outputs"):
            vals = g.get(key, [])
            if not isinstance(vals, list):
                problems.append(f"{where}: '{key}' must be a list of value names")
                continue
            bad = [v for v in vals if v is not None and (not isinstance(v, str) or v not in values)]
            if bad:
                problems.append(f"{where}: {key} {bad[:5]} are not values of the graph")
    uncovered = [n.name for n in graph.nodes if n.name not in owner]
    if uncovered:
        problems.append(f"meta.kernels: nodes {uncovered[:5]} (of {len(uncovered)}) are in no kernel group")


def check_memory_plan_shape(graph: Graph, problems: list[str]) -> None:
    from portlayer.flatten.ir import eval_dim

    plan = graph.meta["memory_plan"]
    if not isinstance(plan, dict) or not isinstance(plan.get("buffers"), dict):
        problems.append("meta.memory_plan must be an object with a 'buffers' object (value name -> placement)")
        return
    align, arena, top = plan.get("alignment"), plan.get("arena_bytes"), plan.get("max_tokens")
    for key, v in (("alignment", align), ("arena_bytes", arena), ("max_tokens", top)):
        if not _is_int(v) or v < (1 if key != "arena_bytes" else 0):
            problems.append(f"meta.memory_plan.{key} must be a {'non-negative' if key == 'arena_bytes' else 'positive'} "
                            f"integer, found {v!r}")
            return
    values = _values(graph)
    n_kernels = len(graph.meta.get("kernels", [])) if isinstance(graph.meta.get("kernels"), list) else None
    for name, b in plan["buffers"].items():
        where = f"memory_plan buffer {name!r}"
        if name not in values:
            problems.append(f"{where}: not a value of the graph")
        if not isinstance(b, dict):
            problems.append(f"{where}: a placement is an object {{offset, size, start, end}}")
            continue
        start, end = b.get("start"), b.get("end")
        if not (_is_int(start) and _is_int(end) and 0 <= start <= end):
            problems.append(f"{where}: live range [start={start!r}, end={end!r}] must be integers with 0 <= start <= end")
        elif n_kernels is not None and end > n_kernels:
            problems.append(f"{where}: live until kernel {end}, but there are {n_kernels} kernel groups")
        for t in (*SAMPLE_TOKENS, top):
            bind = {"num_tokens": t, "num_seqs": t}
            try:
                off, size = eval_dim(b.get("offset"), bind), eval_dim(b.get("size"), bind)
            except Exception as e:  # an unparsable or unbound expression: report, do not crash
                problems.append(f"{where}: offset/size {b.get('offset')!r}/{b.get('size')!r} cannot be evaluated "
                                f"({type(e).__name__}: {str(e)[:120]})")
                break
            if off < 0 or size < 0:
                problems.append(f"{where}: offset {off} / size {size} at num_tokens={t} must be non-negative")
                break
            if t == top and off + size > arena:
                problems.append(f"{where}: [{off}, {off + size}) at num_tokens={t} ends past arena_bytes={arena}")
                break
