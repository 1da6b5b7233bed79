"""fuse: group nodes into kernels (graph.meta["kernels"], docs/contracts.md).

Start from one group per node; vendor calls claimed at select (npu_add_rms_norm, npu_mrope)
are sealed groups; views join their producer's group. Candidate merges — producer into
consumer, the q/k rope pair side by side, and GEMMs of one input side by side (Q, K, V) — are ranked by bytes saved (from the op types
at one token: an intermediate that no longer leaves the kernel saves its write and read, one
still needed elsewhere saves a read), and each is taken when ``fuse_rules.can_fuse`` allows
it. The node list is then reordered so each kernel's nodes are contiguous, in a topological
order of the kernels.
"""

from __future__ import annotations

from typing import Any

from portlayer.backends.impls import find
from portlayer.codegen.gemm_rule import gemv_max_weight_bytes
from portlayer.codegen.lowering import resolve_group
from portlayer.flatten.ir import Graph, Node
from portlayer.passes.context import PassContext
from portlayer.passes.fuse_kv import assign_kv_writes
from portlayer.passes.fuse_rules import FuseState, anchor_of, can_fuse, is_view, kind

BINDINGS = {"num_tokens": 1, "num_seqs": 1}


def _union(st: FuseState, a: int, b: int) -> int:
    keep, drop = min(a, b), max(a, b)
    for m in st.members.pop(drop):
        st.group_of[m] = keep
        st.members[keep].add(m)
    if drop in st.sealed:
        st.sealed[keep] = st.sealed.pop(drop)
    return keep


def _initial(st: FuseState) -> None:
    for i, n in enumerate(st.graph.nodes):
        st.group_of[n.name] = i
        st.members[i] = {n.name}
    for n in st.graph.nodes:
        root = n.meta.get("fused_into")
        if root:
            _union(st, st.group_of[n.name], st.group_of[root])
        if n.meta.get("absorbs"):
            st.sealed[st.group_of[n.name]] = n.meta["impl"]
    for n in st.graph.nodes:
        if is_view(n):
            p = st.prod.get(n.inputs[0])
            if p is not None:
                _union(st, st.group_of[p.name], st.group_of[n.name])


def _candidates(st: FuseState, users: dict[str, list[Node]]) -> list[tuple[int, int, str, str]]:
    """(bytes saved, first node order, a node of group a, a node of group b), best first."""
    out: dict[tuple[int, int], int] = {}
    rep: dict[tuple[int, int], tuple[str, str]] = {}
    for n in st.graph.nodes:
        ga = st.group_of[n.name]
        for v in n.outputs:
            us = users.get(v.name, [])
            for u in us:
                gb = st.group_of[u.name]
                if gb == ga:
                    continue
                outside = [x for x in us if st.group_of[x.name] not in (ga, gb)] or v.name in st.graph.outputs
                saved = v.type.nbytes(BINDINGS) * (1 if outside else 2)
                key = (ga, gb)
                out[key] = max(out.get(key, 0), saved)
                rep.setdefault(key, (n.name, u.name))
    ropes = [n for n in st.graph.nodes if n.op == "rope"]
    for i, r in enumerate(ropes):
        for s in ropes[i + 1:]:
            ga, gb = st.group_of[r.name], st.group_of[s.name]
            if ga != gb and r.inputs[1:] == s.inputs[1:]:
                out.setdefault((ga, gb), st.types[r.inputs[1]].nbytes(BINDINGS))
                rep.setdefault((ga, gb), (r.name, s.name))
    by_input: dict[str, list[Node]] = {}
    for n in st.graph.nodes:
        if kind(n) == "gemm" and n.inputs:
            by_input.setdefault(n.inputs[0], []).append(n)
    for x, lins in by_input.items():  # projections of one input side by side: the input is read once
        for i, a in enumerate(lins):
            for b in lins[i + 1:]:
                ga, gb = st.group_of[a.name], st.group_of[b.name]
                if ga != gb:
                    out.setdefault((ga, gb), st.types[x].nbytes(BINDINGS))
                    rep.setdefault((ga, gb), (a.name, b.name))
    first = {g: min(st.order[m] for m in ms) for g, ms in st.members.items()}
    return sorted(((s, first[a], *rep[(a, b)]) for (a, b), s in out.items()), key=lambda t: (-t[0], t[1]))


def _group_order(st: FuseState) -> list[int]:
    deps: dict[int, set[int]] = {g: set() for g in st.members}
    for n in st.graph.nodes:
        g = st.group_of[n.name]
        for i in n.inputs:
            p = st.prod.get(i) if i else None
            if p is not None and st.group_of[p.name] != g:
                deps[g].add(st.group_of[p.name])
    first = {g: min(st.order[m] for m in ms) for g, ms in st.members.items()}
    done: list[int] = []
    placed: set[int] = set()
    pending = sorted(st.members, key=first.__getitem__)
    while pending:
        for g in pending:
            if deps[g] <= placed:
                done.append(g)
                placed.add(g)
                pending.remove(g)
                break
        else:
            raise RuntimeError(f"fuse: kernel groups form a cycle among {pending[:5]}; this is a bug in fuse_rules.can_fuse")
    return done


def _name_and_impl(st: FuseState, gid: int, nodes: list[Node]) -> tuple[str, str, str]:
    """(anchor node, kernel family for display, implementation whose lowering realises the group)."""
    gk = st.group_kind(gid)
    comp = [n for n in nodes if not is_view(n)]
    if gk == "vendor":
        root = next(n for n in comp if n.meta.get("absorbs"))
        return root.name, "vendor", st.sealed[gid]
    if not comp:
        return nodes[0].name, "view", nodes[0].meta.get("impl", "torch.view")
    anchor = anchor_of(comp)
    family = {"gemm": "gemm", "rope": "rope", "reduction": "reduction", "attention": "attention",
              "embedding": "embedding", "pooling": "pooling"}.get(gk, "pointwise" if gk == "pointwise" else "data")
    return anchor.name, family, anchor.meta.get("impl", "reference")


def _scratch(g: Graph, k: dict[str, Any], st: FuseState, users: dict[str, list[Node]]) -> list[str]:
    """Group-internal values the lowering writes to memory (it says which; the memory plan places them)."""
    impl = find(k["impl"], st.nodes[k["anchor"]].op)
    if impl is None or impl.scratch is None:
        return []
    return list(impl.scratch(resolve_group(g, k, st.nodes, users)))


def _gemv_rows(ctx: PassContext) -> int:
    """The few-rows GEMMs' row limit (either tier) where this target generates them (as backends/generate.py
    reads it): a norm prologue or a joint epilogue is worth forming when any few-rows kernel runs."""
    from portlayer.codegen.gemm_rule import few_rows_limit

    if getattr(ctx.descriptor, "codegen", None) != "triton" or "gemv" not in (ctx.plan.launch_configs or {}):
        return 0
    return few_rows_limit(ctx.descriptor)


def fuse(graph: Graph, ctx: PassContext) -> Graph:
    g = graph.copy()
    limit = int(ctx.options.get("max_fused_inputs") or ctx.plan.max_fused_inputs)
    st = FuseState(g, limit, gemv_rows=_gemv_rows(ctx), gemv_weight_bytes=gemv_max_weight_bytes(ctx.descriptor))
    _initial(st)
    users = g.users()
    refusals: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for _, _, na, nb in _candidates(st, users):
            ga, gb = st.group_of[na], st.group_of[nb]
            if ga == gb:
                continue
            ok, why = can_fuse(st, ga, gb, users)
            if ok:
                _union(st, ga, gb)
                changed = True
            else:
                refusals[f"{na}+{nb}"] = why
    order = _group_order(st)
    kernels: list[dict[str, Any]] = []
    new_nodes: list[Node] = []
    produced_by: dict[str, int] = {}
    for gi, gid in enumerate(order):
        nodes = sorted((st.nodes[m] for m in st.members[gid]), key=lambda n: st.order[n.name])
        anchor, family, impl = _name_and_impl(st, gid, nodes)
        name = f"k{gi:03d}_{anchor}"
        names = {n.name for n in nodes}
        outs = [v.name for n in nodes for v in n.outputs
                if v.name in g.outputs or any(u.name not in names for u in users.get(v.name, []))]
        k: dict[str, Any] = {"name": name, "family": family, "impl": impl, "anchor": anchor,
                             "nodes": [n.name for n in nodes], "inputs": st.external_inputs(names), "outputs": outs}
        if family == "gemm":  # a norm prologue feeds the linears; the epilogue follows them
            comp = [n for n in nodes if not is_view(n)]
            first = next(i for i, n in enumerate(comp) if kind(n) == "gemm")
            k["epilogue"] = [n.name for n in comp[first:] if kind(n) != "gemm"]
            if first:
                k["prologue"] = [n.name for n in comp[:first]]
        scratch = _scratch(g, k, st, users)
        if scratch:
            k["scratch"] = scratch
        kernels.append(k)
        for n in nodes:
            n.meta["kernel"] = name
            produced_by[n.name] = gi
        new_nodes += nodes
    g.nodes = new_nodes
    kv_refused = assign_kv_writes(g, kernels)
    g.meta["kernels"] = kernels
    g.meta["fusion"] = {"nodes": len(g.nodes), "kernels": len(kernels), "max_fused_inputs": limit,
                        "refused": dict(sorted(refusals.items())[:200])}
    if kv_refused:
        g.meta["fusion"]["kv_write_refused"] = dict(sorted(kv_refused.items())[:50])
    return g
