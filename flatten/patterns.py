"""Raise decomposed chains to portable ops: rms_norm, rope, gelu, layer_norm; fold view chains.

Each raiser is a pure function ``Graph -> Graph`` that matches on structure and checks the
numbers where structure alone is not proof (rope cos/sin tables are evaluated once over all
positions and must have the rotate-half symmetry). What does not match stays as it was:
the graph is always still correct, just less portable.
"""

from __future__ import annotations

import math

from portlayer.flatten.ir import Graph, GraphBuilder, Node
from portlayer.flatten.rewrite import Pat, Rewriter, Var, dce, match
from portlayer.flatten.rope_pattern import raise_rope

__all__ = ["fold_view_chains", "raise_gelu", "raise_layer_norm", "raise_patterns", "raise_rms_norm", "raise_rope"]

VIEW_OPS = {"reshape", "transpose", "permute"}


def _arg(n: Node, i: int) -> str | None:
    return n.inputs[i] if i < len(n.inputs) else None


def _strip_casts(rw: Rewriter, v: str) -> str:
    n = rw.producer(v)
    while n is not None and n.op == "cast":
        v = n.inputs[0]
        n = rw.producer(v)
    return v


def _last_axis(rw: Rewriter, value: str, dims: list[int]) -> bool:
    rank = rw.type(value).rank
    return len(dims) == 1 and dims[0] % rank == rank - 1


# ---- rms_norm ---------------------------------------------------------------------------------


def raise_rms_norm(graph: Graph) -> Graph:
    """x * rsqrt(mean(x^2, -1) + eps) [cast] [* w]  ->  rms_norm(x, w, eps)."""
    g = graph.copy()
    rw = Rewriter(g)
    for r in [n for n in g.nodes if n.op == "rsqrt"]:
        if r.name not in rw.index:
            continue
        add = rw.producer(r.inputs[0])
        if add is None or add.op != "add" or add.attrs.get("scalar") is None or _arg(add, 1) is not None:
            continue
        eps = float(add.attrs["scalar"])
        mean = rw.producer(add.inputs[0])
        if mean is None or mean.op != "mean" or not mean.attrs["keepdim"]:
            continue
        sq = rw.producer(mean.inputs[0])
        if sq is None:
            continue
        if sq.op == "pow" and sq.attrs.get("scalar") == 2 and _arg(sq, 1) is None:
            a = sq.inputs[0]
        elif sq.op == "mul" and sq.inputs[0] == _arg(sq, 1):
            a = sq.inputs[0]
        else:
            continue
        if not _last_axis(rw, a, mean.attrs["dims"]):
            continue
        x = _strip_casts(rw, a)
        for u in rw.users(r.name):
            if u.op != "mul" or _arg(u, 1) is None:
                continue
            other = u.inputs[0] if u.inputs[1] == r.name else u.inputs[1]
            if _strip_casts(rw, other) != x:
                continue
            root, weight, offset = u, None, 0.0
            tail = u
            users = rw.users(tail.name)
            if len(users) == 1 and users[0].op == "cast":
                tail = users[0]
                users = rw.users(tail.name)
            root = tail
            if len(users) == 1 and users[0].op == "mul" and _arg(users[0], 1) is not None:
                m = users[0]
                w = m.inputs[0] if m.inputs[1] == tail.name else m.inputs[1]
                wn = rw.producer(w)
                if wn is not None and wn.op == "add" and wn.attrs.get("scalar") is not None and wn.inputs[0] in g.params:
                    w, offset = wn.inputs[0], float(wn.attrs["scalar"])
                if w in g.params and rw.type(w).rank == 1 and rw.type(w).shape[0] == rw.type(x).shape[-1]:
                    weight, root = w, m
            want = rw.type(root.name)

            def build(b: GraphBuilder, x: str = x, weight: str | None = weight, eps: float = eps,
                      offset: float = offset, root: Node = root, want=want) -> str:
                out = b.add1("rms_norm", [x, weight], {"eps": eps, "weight_offset": offset},
                             name=f"{root.name}_rms_norm", meta=dict(root.meta))
                if b.types[out].dtype != want.dtype:
                    out = b.add1("cast", [out], {"dtype": want.dtype}, name=f"{root.name}_cast", meta=dict(root.meta))
                return out

            new = rw.insert_before(root, build)
            rw.replace_uses(root.name, new)
            break
    return dce(g)


# ---- gelu ---------------------------------------------------------------------------------------

_GELU_TANH = Pat("mul", (
    Pat("mul", (Var("x"),), scalar=0.5),
    Pat("add", (Pat("tanh", (Pat("mul", (Pat("add", (Var("x"), Pat("mul", (Pat("pow", (Var("x"),), scalar=3.0),), scalar=0.044715))),),
                                         scalar=math.sqrt(2.0 / math.pi)),)),), scalar=1.0),
))
_GELU_ERF = Pat("mul", (
    Pat("mul", (Var("x"),), scalar=0.5),
    Pat("add", (Pat("erf", (Pat("mul", (Var("x"),), scalar=1.0 / math.sqrt(2.0)),)),), scalar=1.0),
))
_GELU_ERF_DIV = Pat("mul", (
    Pat("mul", (Var("x"),), scalar=0.5),
    Pat("add", (Pat("erf", (Pat("div", (Var("x"),), scalar=math.sqrt(2.0)),)),), scalar=1.0),
))


def raise_gelu(graph: Graph) -> Graph:
    """0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))) -> gelu(tanh); 0.5*x*(1+erf(x/sqrt 2)) -> gelu."""
    g = graph.copy()
    rw = Rewriter(g)
    for n in [n for n in g.nodes if n.op == "mul"]:
        if n.name not in rw.index:
            continue
        for pat, approx in ((_GELU_TANH, "tanh"), (_GELU_ERF, "none"), (_GELU_ERF_DIV, "none")):
            env = match(rw, pat, n.name)
            if env is None:
                continue

            def build(b: GraphBuilder, x: str = env["x"], approx: str = approx, n: Node = n) -> str:
                return b.add1("gelu", [x], {"approximate": approx}, name=f"{n.name}_gelu", meta=dict(n.meta))

            rw.replace_uses(n.name, rw.insert_before(n, build))
            break
    return dce(g)


# ---- layer_norm (decomposed) -------------------------------------------------------------------


def raise_layer_norm(graph: Graph) -> Graph:
    """(x - mean(x)) * rsqrt(mean((x - mean)^2) + eps) [* w] [+ b] -> layer_norm(x, w, b, eps)."""
    g = graph.copy()
    rw = Rewriter(g)
    centered = Pat("sub", (Var("x"), Pat("mean", (Var("x"),), bind="mu")), bind="xc")
    var = Pat("mean", (Pat("pow", (Var("xc_v"),), scalar=2.0),), bind="var")
    for n in [n for n in g.nodes if n.op == "mul"]:
        if n.name not in rw.index:
            continue
        env = match(rw, Pat("mul", (Var("xc_v"), Pat("rsqrt", (Pat("add", (var,), bind="eps_add"),)))), n.name)
        if env is None or match(rw, centered, env["xc_v"]) is None:
            continue
        env.update(match(rw, centered, env["xc_v"]))
        x = env["x"]
        if not (_last_axis(rw, x, g.node(env["mu"]).attrs["dims"]) and _last_axis(rw, x, g.node(env["var"]).attrs["dims"])):
            continue
        eps = float(g.node(env["eps_add"]).attrs["scalar"])
        root, w, bias = n, None, None
        users = rw.users(root.name)
        if len(users) == 1 and users[0].op == "mul" and _arg(users[0], 1) is not None:
            other = users[0].inputs[0] if users[0].inputs[1] == root.name else users[0].inputs[1]
            if other in g.params and rw.type(other).rank == 1:
                w, root = other, users[0]
                users = rw.users(root.name)
        if w is not None and len(users) == 1 and users[0].op == "add" and _arg(users[0], 1) is not None:
            other = users[0].inputs[0] if users[0].inputs[1] == root.name else users[0].inputs[1]
            if other in g.params and rw.type(other).rank == 1:
                bias, root = other, users[0]

        def build(b: GraphBuilder, x: str = x, w=w, bias=bias, eps: float = eps, root: Node = root) -> str:
            return b.add1("layer_norm", [x, w, bias], {"eps": eps}, name=f"{root.name}_layer_norm", meta=dict(root.meta))

        rw.replace_uses(root.name, rw.insert_before(root, build))
    return dce(g)


# ---- view-chain folding ------------------------------------------------------------------------


def fold_view_chains(graph: Graph) -> Graph:
    """Collapse chains of reshape/transpose/permute that only move unit axes or cancel out.

    Non-unit axes are tracked as labels through the chain; wherever they are back in their
    original order the value equals ``reshape(root, shape)``, so the chain is replaced by
    that single reshape (or by the root itself when the shapes agree).
    """
    g = graph.copy()
    rw = Rewriter(g)
    for n in list(g.nodes):
        if n.op not in VIEW_OPS or n.name not in rw.index:
            continue
        chain = [n]
        p = rw.producer(n.inputs[0])
        while p is not None and p.op in VIEW_OPS:
            chain.append(p)
            p = rw.producer(p.inputs[0])
        if len(chain) < 2 and n.op != "reshape":
            continue
        chain.reverse()
        root = chain[0].inputs[0]
        if not _chain_is_reshape(rw, root, chain):
            continue
        out_shape = rw.type(n.name).shape
        if tuple(rw.type(root).shape) == tuple(out_shape):
            rw.replace_uses(n.name, root)
            continue
        if len(chain) == 1:
            continue

        def build(b: GraphBuilder, root: str = root, out_shape=out_shape, n: Node = n) -> str:
            return b.add1("reshape", [root], {"shape": list(out_shape)}, name=f"{n.name}_v", meta=dict(n.meta))

        rw.replace_uses(n.name, rw.insert_before(n, build))
    return dce(g)


def _chain_is_reshape(rw: Rewriter, root: str, chain: list[Node]) -> bool:
    shape = list(rw.type(root).shape)
    labels: list[int | None] = []
    k = 0
    for d in shape:
        if d == 1:
            labels.append(None)
        else:
            labels.append(k)
            k += 1
    for node in chain:
        out = list(rw.type(node.name).shape)
        if node.op == "transpose":
            i, j = node.attrs["dim0"] % len(labels), node.attrs["dim1"] % len(labels)
            labels[i], labels[j] = labels[j], labels[i]
        elif node.op == "permute":
            labels = [labels[d % len(labels)] for d in node.attrs["dims"]]
        else:
            before = [d for d in shape if d != 1]
            after = [d for d in out if d != 1]
            present = [lab for lab in labels if lab is not None]
            if before == after:
                it = iter(present)
                labels = [None if d == 1 else next(it) for d in out]
            elif present == sorted(present) and present == list(range(len(present))):
                labels, k = [], 0
                for d in out:
                    labels.append(None if d == 1 else k)
                    k += d != 1
                # the value is reshape(root, out): relabel relative to root's own axes only if
                # root's non-unit dims are what we track; a merge/split changes them, so
                # from here on only "in order" can be concluded, which is what we need.
            else:
                return False
        shape = out
    present = [lab for lab in labels if lab is not None]
    return present == sorted(present)


def raise_patterns(graph: Graph) -> Graph:
    """All raisers in order, then view-chain folding and dead-code removal."""
    from portlayer.flatten.attention_pattern import raise_attention_chains
    from portlayer.flatten.squeeze_batch import squeeze_unit_batch

    for fn in (raise_rms_norm, raise_layer_norm, raise_gelu, raise_rope, raise_attention_chains, fold_view_chains,
               squeeze_unit_batch, fold_view_chains):
        graph = fn(graph)
    from portlayer.flatten.mla_pattern import raise_mla

    graph = raise_mla(graph)  # DeepSeek's latent attention: proven on the graph, or left expanded
    from portlayer.flatten.naming import rename_from_source

    return rename_from_source(dce(graph))
