"""memory plan: one arena for all activations, offsets reused across liveness.

Time is the kernel index (graph.meta["kernels"], or one kernel per node before fusion). A
buffer is a kernel output that is not a view (views alias their base and extend its life);
values that stay inside a fused kernel need none. Graph outputs live to the end; inputs and
weights are not planned. Sizes are expressions in ``num_tokens`` rounded up to the plan's
``buffer_alignment``.

Offsets are planned (best fit, in start order) at the largest bucket, ``max_batched_tokens``:
every size grows with ``num_tokens``, so the same offsets stay disjoint for any smaller step
and the arena is allocated once (what graph capture needs). ``peak_bytes`` reports the arena
the same planner needs at each bucket; ``no_reuse_bytes`` gives every buffer its own bytes.
A pointwise/row kernel whose implementation allows it writes in place over an input of the
same size that dies in it. ``memory_check.check_memory_plan`` proves the result.
"""

from __future__ import annotations

from typing import Any

from portlayer.backends.impls import find
from portlayer.flatten.ir import Graph, TensorType, dtype_itemsize, eval_dim, normalize_dim
from portlayer.flatten.ops import get_op
from portlayer.passes.context import PassContext
from portlayer.passes.memory_check import check_memory_plan

INPLACE_FAMILIES = ("pointwise", "reduction", "rope", "vendor")


def _kernels(g: Graph) -> list[dict[str, Any]]:
    if g.meta.get("kernels"):
        return g.meta["kernels"]
    users = g.users()
    return [{"name": n.name, "family": get_op(n.op).kind, "nodes": [n.name], "inputs": [i for i in n.inputs if i],
             "outputs": [v.name for v in n.outputs if v.name in g.outputs or users.get(v.name)]} for n in g.nodes]


def size_expr(t: TensorType, align: int) -> int | str:
    """Bytes of ``t`` rounded up to ``align``, as an int or an expression in its symbols."""
    nbytes = normalize_dim("*".join(f"({d})" for d in t.shape) + f"*{dtype_itemsize(t.dtype)}" if t.shape
                           else dtype_itemsize(t.dtype))
    if isinstance(nbytes, int):
        return -(-nbytes // align) * align
    return normalize_dim(f"{align}*ceiling(({nbytes})/{align})")


def _buckets(ctx: PassContext) -> list[int]:
    p = ctx.plan
    extra = list(ctx.options.get("memory_buckets", [512]))
    return sorted({1, *p.graph_capture_sizes, p.prefill_chunk_size, p.max_batched_tokens, *extra})


def _inplace_ok(g: Graph, k: dict[str, Any], nodes: dict[str, Any]) -> bool:
    if k["family"] not in INPLACE_FAMILIES:
        return False
    for name in k["nodes"]:
        n = nodes[name]
        if get_op(n.op).kind == "view":
            continue
        impl = find(n.meta.get("impl", ""), n.op)
        if impl is None or not impl.trait("inplace"):
            return False
    return True


def _feeding_inputs(k: dict[str, Any], value: str, prod: dict[str, Any], nodes: dict[str, Any]) -> list[str]:
    """The kernel's external inputs that ``value`` is computed from inside the kernel: the only ones
    it may overwrite (a q/k rope kernel stores q before it loads k, so q must not take k's bytes)."""
    members, ext = set(k["nodes"]), set(k["inputs"])
    seen, stack, out = set(), [value], []
    while stack:
        v = stack.pop()
        p = prod.get(v)
        if p is None or p.name not in members or p.name in seen:
            continue
        seen.add(p.name)
        for i in p.inputs:
            if i is None:
                continue
            if i in ext and i not in out:
                out.append(i)
            stack.append(i)
    return [i for i in k["inputs"] if i in out]


def place(bufs: dict[str, dict[str, Any]], sizes: dict[str, int], align: int) -> dict[str, int]:
    """Best-fit offsets in start order; in-place candidates take their input's offset."""
    off: dict[str, int] = {}
    for b, info in bufs.items():
        y = info.get("inplace_of")
        if y is not None and y in off and sizes[y] >= sizes[b]:
            off[b] = off[y]
            continue
        busy = sorted((off[o], off[o] + sizes[o]) for o in off
                      if bufs[o]["start"] <= info["end"] and info["start"] <= bufs[o]["end"]
                      and not (bufs[b].get("inplace_of") == o))
        best, cursor = None, 0
        for lo, hi in busy + [(1 << 62, 1 << 62)]:
            gap = lo - cursor
            if gap >= sizes[b] and (best is None or gap < best[1]):
                best = (cursor, gap)
            cursor = max(cursor, -(-hi // align) * align)
        off[b] = best[0] if best else cursor
    return off


def _most_live(bufs: dict[str, dict[str, Any]], sizes: dict[str, int], n_kernels: int) -> int:
    """The most bytes live at one kernel index (a sweep over [start, end] intervals, not kernels x buffers)."""
    delta = [0] * (n_kernels + 2)
    for b, info in bufs.items():
        delta[info["start"]] += sizes[b]
        delta[info["end"] + 1] -= sizes[b]
    most = cur = 0
    for d in delta[: n_kernels + 1]:
        cur += d
        most = max(most, cur)
    return most


def memory_plan(graph: Graph, ctx: PassContext) -> Graph:
    g = graph.copy()
    align = int(ctx.plan.buffer_alignment)
    kernels = _kernels(g)
    prod, types = g.producers(), g.value_types()
    nodes = {n.name: n for n in g.nodes}
    external = {v.name for v in g.inputs} | set(g.params)

    def base(v: str) -> str:
        p = prod.get(v)
        while p is not None and get_op(p.op).kind == "view":
            v = p.inputs[0]
            p = prod.get(v)
        return v

    bufs: dict[str, dict[str, Any]] = {}
    for t, k in enumerate(kernels):
        for v in k.get("scratch", []):  # written and read inside one kernel (the lowering said so)
            bufs[v] = {"offset": 0, "size": size_expr(types[v], align), "start": t, "end": t, "scratch": True}
        for v in k["outputs"]:
            b = base(v)
            if b in external:
                continue
            if b not in bufs:
                bufs[b] = {"offset": 0, "size": size_expr(types[b], align), "start": t, "end": t}
            if v != b:
                bufs[b].setdefault("aliases", []).append(v)
    owner = {a: b for b, info in bufs.items() for a in [b, *info.get("aliases", [])]}
    for t, k in enumerate(kernels):
        for i in k["inputs"]:
            b = owner.get(base(i))
            if b is not None:
                bufs[b]["end"] = max(bufs[b]["end"], t)
    outs = {owner.get(base(o)) for o in g.outputs}
    for b in outs - {None}:
        bufs[b]["end"] = len(kernels)
    bufs = dict(sorted(bufs.items(), key=lambda kv: kv[1]["start"]))
    taken: set[str] = set()
    for b, info in bufs.items():
        k = kernels[info["start"]]
        if info.get("scratch") or not _inplace_ok(g, k, nodes):
            continue
        for i in _feeding_inputs(k, b, prod, nodes):
            y = owner.get(base(i))
            if y and y not in taken and y not in outs and bufs[y]["end"] == info["start"] and \
                    bufs[y]["size"] == info["size"] and bufs[y]["start"] < info["start"]:
                info["inplace_of"] = y
                taken.add(y)
                break
    buckets = _buckets(ctx)
    top = max(buckets)
    peak, no_reuse, live = {}, {}, {}
    for n in buckets:
        bind = {"num_tokens": n, "num_seqs": n}
        value = {d: eval_dim(d, bind) for d in {info["size"] for info in bufs.values()}}  # layers repeat sizes
        sizes = {b: value[info["size"]] for b, info in bufs.items()}
        off = place(bufs, sizes, align)
        peak[str(n)] = max((off[b] + sizes[b] for b in bufs), default=0)
        no_reuse[str(n)] = sum(sizes.values())
        live[str(n)] = _most_live(bufs, sizes, len(kernels))
        if n == top:
            for b in bufs:
                bufs[b]["offset"] = off[b]
    plan: dict[str, Any] = {"alignment": align, "max_tokens": top, "buffers": bufs, "arena_bytes": peak[str(top)],
                            "peak_bytes": peak, "no_reuse_bytes": no_reuse, "live_lower_bound_bytes": live}
    plan["checked_pairs"] = check_memory_plan(plan)
    g.meta["memory_plan"] = plan
    return g
