"""select, the execution-primitive mapper: for each node, the highest-priority implementation
whose predicates accept the descriptor and the node.

Fused vendor calls (``Impl.match``) are tried first from the last node backwards, so the
call's root (rms_norm after its residual add, the k rope after the q rope) claims the nodes
it absorbs before they are considered alone. Every node records ``impl``, ``impl_family``
and, for each higher-priority candidate, ``refused`` with the reason. A node no registered
implementation accepts runs the op's reference semantics through torch, with a warning.
This pass names no device: all it knows comes from the descriptor through the predicates.
"""

from __future__ import annotations

import warnings

from portlayer.backends.impls import GraphView, Impl, candidates
from portlayer.flatten.ir import Graph, Node
from portlayer.passes.context import PassContext

REFERENCE = "reference"


class FallbackWarning(UserWarning):
    """A node runs the reference implementation because no registered one accepts it."""


def _try(impl: Impl, node: Node, ctx: PassContext, view: GraphView) -> tuple[bool, str, list[str]]:
    ok, why = impl.supported(ctx.descriptor)
    if not ok:
        return False, why, []
    ok, why = impl.supports(node, view.types)
    if not ok:
        return False, why, []
    if impl.match is not None:
        absorbed, why = impl.match(node, view)
        if absorbed is None:
            return False, why, []
        return True, why, absorbed
    if impl.accepts is not None:  # the lowering must take the node alone (the smallest group fuse can form)
        ok, why2 = impl.accepts(view, [node])
        if not ok:
            return False, why2, []
    return True, why, []


def select(graph: Graph, ctx: PassContext) -> Graph:
    g = graph.copy()
    view = GraphView(g)
    by_name = {n.name: n for n in g.nodes}
    claimed: dict[str, str] = {}
    for n in reversed(g.nodes):
        if n.name in claimed:
            continue
        refused: list[dict[str, str]] = []
        chosen: Impl | None = None
        for impl in candidates(n.op):
            ok, why, absorbed = _try(impl, n, ctx, view)
            if ok and any(a in claimed for a in absorbed):
                ok, why = False, f"{[a for a in absorbed if a in claimed]} already belong to another fused call"
            if not ok:
                refused.append({"impl": impl.name, "reason": why})
                continue
            chosen = impl
            for a in absorbed:
                claimed[a] = n.name
                m = by_name[a].meta
                m.update(impl=impl.name, impl_family=impl.family, fused_into=n.name)
                m.pop("refused", None)
            if absorbed:
                n.meta["absorbs"] = absorbed
            break
        n.meta.pop("fused_into", None)
        if chosen is None:
            warnings.warn(
                f"select: no implementation of {n.op!r} accepts node {n.name} (from {n.meta.get('source', '?')}) "
                f"on {ctx.descriptor.name}; it runs the reference semantics through torch. Refusals: "
                + "; ".join(f"{r['impl']}: {r['reason']}" for r in refused) + ". Register an implementation in "
                "backends/impls_*.py or edit the descriptor.",
                FallbackWarning, stacklevel=2,
            )
            n.meta.update(impl=REFERENCE, impl_family="torch", refused=refused)
        else:
            n.meta.update(impl=chosen.name, impl_family=chosen.family, refused=refused)
    return g
