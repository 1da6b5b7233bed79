"""Raise rope: x*cos + rotate(x)*sin, with cos/sin functions of positions only, to one op.

Split from patterns.py (one concept per file); patterns.raise_patterns runs it.
"""

from __future__ import annotations

import torch

from portlayer.flatten.ir import Graph, GraphBuilder, Node, dim_symbols
from portlayer.flatten.rewrite import Pat, Rewriter, Var, dce, match

# --------------------------------------------------------------------------------------


def _backward_slice(rw: Rewriter, values: list[str]) -> tuple[list[Node], set[str]]:
    """Nodes computing ``values`` (in graph order) and the graph inputs they read."""
    need: set[str] = set()
    stack = list(values)
    inputs: set[str] = set()
    graph_inputs = {v.name for v in rw.g.inputs}
    while stack:
        v = stack.pop()
        if v in graph_inputs:
            inputs.add(v)
            continue
        n = rw.producer(v)
        if n is None or n.name in need:
            continue
        need.add(n.name)
        stack.extend(i for i in n.inputs if i is not None)
    return [n for n in rw.g.nodes if n.name in need], inputs


def _position_table(rw: Rewriter, value: str, token_axis: int, max_pos: int) -> torch.Tensor | None:
    """Evaluate a positions-only value for positions 0..max_pos-1 as [max_pos, features]."""
    from portlayer.flatten.interpret import ExecContext, run_graph

    nodes, inputs = _backward_slice(rw, [value])
    if inputs != {"positions"} or any(n.op in ("attention", "pooling") for n in nodes):
        return None
    sub = Graph(inputs=[v for v in rw.g.inputs if v.name == "positions"], params=dict(rw.g.params),
                nodes=nodes, outputs=[value], weights=rw.g.weights)
    pos = torch.arange(max_pos)
    out = run_graph(sub, {"positions": pos}, ExecContext(bindings={"num_tokens": max_pos}))[0]
    out = out.movedim(token_axis, 0)
    if out.shape[0] != max_pos or out[0].numel() != out.shape[-1]:
        return None
    return out.reshape(max_pos, -1).float()


def _neox_match(rw: Rewriter, s: Node) -> dict[str, str] | None:
    rotate = Pat("concat", (Pat("neg", (Pat("slice", (Var("x",),), bind="hi"),)), Pat("slice", (Var("x"),), bind="lo")))
    pat = Pat("add", (Pat("mul", (Var("x"), Var("cos"))), Pat("mul", (rotate, Var("sin")))))
    env = match(rw, pat, s.name)
    if env is None:
        return None
    x = env["x"]
    d = rw.type(x).shape[-1]
    hi, lo = rw.g.node(env["hi"]).attrs, rw.g.node(env["lo"]).attrs
    rank = rw.type(x).rank
    if not isinstance(d, int) or d % 2:
        return None
    h = d // 2
    if hi["dim"] % rank != rank - 1 or lo["dim"] % rank != rank - 1:
        return None
    if (hi["start"], lo["start"]) != (h, 0) or lo["end"] != h or hi["end"] not in (None, d) or hi["step"] != 1:
        return None
    return env


def _gptj_match(rw: Rewriter, s: Node) -> dict[str, str] | None:
    """x*cos + rotate_every_two(x)*sin with rotate_every_two = stack(-x[..., 1::2], x[..., ::2], -1).flatten(-2)."""
    odd = Pat("reshape", (Pat("neg", (Pat("slice", (Var("x"),), bind="odd"),)),))
    even = Pat("reshape", (Pat("slice", (Var("x"),), bind="even"),))
    rotate = Pat("reshape", (Pat("concat", (odd, even)),))
    env = match(rw, Pat("add", (Pat("mul", (Var("x"), Var("cos"))), Pat("mul", (rotate, Var("sin"))))), s.name)
    if env is None:
        return None
    rank = rw.type(env["x"]).rank
    o, e = rw.g.node(env["odd"]).attrs, rw.g.node(env["even"]).attrs
    if o["dim"] % rank != rank - 1 or e["dim"] % rank != rank - 1:
        return None
    if (o["start"], o["step"], e["start"], e["step"]) != (1, 2, 0, 2) or o["end"] is not None or e["end"] is not None:
        return None
    return env


def _token_axis(rw: Rewriter, x: str, c: str) -> int | None:
    xs, cs = rw.type(x).shape, rw.type(c).shape
    off = len(xs) - len(cs)
    for i, dim in enumerate(cs):
        if isinstance(dim, str) and dim_symbols(dim) == {dim} and xs[i + off] == dim:
            return i + off
    return None


def _to_token_major(b: GraphBuilder, x: str, token_axis: int, meta: dict) -> tuple[str, list[int]]:
    """[.., T, .., D] -> [T, H, D] (H = product of the other axes); returns value and perm."""
    shape = b.types[x].shape
    rank = len(shape)
    perm = [token_axis] + [i for i in range(rank - 1) if i != token_axis] + [rank - 1]
    y = x
    if perm != list(range(rank)):
        y = b.add1("permute", [x], {"dims": perm}, name=f"{x}_tm", meta=meta)
    heads = 1
    for i in perm[1:-1]:
        heads *= int(shape[i])
    target = [shape[token_axis], heads, shape[-1]]
    if list(b.types[y].shape) != target:
        y = b.add1("reshape", [y], {"shape": target}, name=f"{x}_thd", meta=meta)
    return y, perm


def _from_token_major(b: GraphBuilder, y: str, like_shape: tuple, perm: list[int], meta: dict) -> str:
    permuted = [like_shape[i] for i in perm]
    z = y
    if list(b.types[y].shape) != permuted:
        z = b.add1("reshape", [y], {"shape": permuted}, name=f"{y}_unflat", meta=meta)
    if perm != list(range(len(perm))):
        inv = [perm.index(i) for i in range(len(perm))]
        z = b.add1("permute", [z], {"dims": inv}, name=f"{y}_back", meta=meta)
    return z


def raise_rope(graph: Graph) -> Graph:
    """x*cos + rotate_half(x)*sin (cos/sin functions of positions only) -> rope(x, positions, cache).

    The cos/sin subgraph is evaluated once for every position up to max_positions into a
    [max_positions, rotary_dim] cos|sin cache (vLLM's layout), so any rope-scaling variant
    HF implements is reproduced exactly; the raise is refused unless the evaluated tables
    have the rotate-half symmetry. Partial rotary (cat(rope(x[..., :r]), x[..., r:])) is
    folded into one op with rotary_dim = r.
    """
    g = graph.copy()
    if "positions" not in {v.name for v in g.inputs}:
        return g
    max_pos = int(g.meta.get("max_positions") or 4096)
    rw = Rewriter(g)
    caches: dict[tuple[str, str], str] = {}
    for s in [n for n in g.nodes if n.op == "add"]:
        if s.name not in rw.index:
            continue
        env, style = _neox_match(rw, s), "neox"
        if env is None:
            env, style = _gptj_match(rw, s), "gptj"
        if env is None:
            continue
        x, cos_v, sin_v = env["x"], env["cos"], env["sin"]
        axis = _token_axis(rw, x, cos_v)
        if axis is None or _token_axis(rw, x, sin_v) != axis:
            continue
        key = (cos_v, sin_v, style)
        if key not in caches:
            coff = len(rw.type(x).shape) - len(rw.type(cos_v).shape)
            cos_t = _position_table(rw, cos_v, axis - coff, max_pos)
            sin_t = _position_table(rw, sin_v, axis - coff, max_pos)
            if cos_t is None or sin_t is None or cos_t.shape != sin_t.shape:
                continue
            h = cos_t.shape[1] // 2
            if style == "neox":
                first, second = (slice(None, h), slice(h, None))
            else:  # gptj: each frequency appears twice, interleaved
                first, second = (slice(0, None, 2), slice(1, None, 2))
            if not (torch.equal(cos_t[:, first], cos_t[:, second]) and torch.equal(sin_t[:, first], sin_t[:, second])):
                continue
            table = torch.cat([cos_t[:, first], sin_t[:, first]], 1).contiguous()
            same = [p for p in caches.values() if torch.equal(g.weights[p], table)]
            caches[key] = same[0] if same else rw.add_param("rope_cos_sin_cache", table)
            rw.refresh()
        cache = caches[key]
        rot_dim = int(rw.type(x).shape[-1])
        full, root = x, s
        xn = rw.producer(x)
        users = rw.users(s.name)
        if (xn is not None and xn.op == "slice" and xn.attrs["start"] == 0 and xn.attrs["step"] == 1
                and xn.attrs["dim"] % rw.type(x).rank == rw.type(x).rank - 1 and len(users) == 1
                and users[0].op == "concat" and users[0].inputs[0] == s.name and len(users[0].inputs) == 2):
            rest = rw.producer(users[0].inputs[1])
            if (rest is not None and rest.op == "slice" and rest.inputs[0] == xn.inputs[0]
                    and rest.attrs["start"] == rot_dim and rest.attrs["end"] in (None, rw.type(xn.inputs[0]).shape[-1])):
                full, root = xn.inputs[0], users[0]
        head_dim = int(rw.type(full).shape[-1])
        meta = dict(s.meta)

        def build(b: GraphBuilder, full: str = full, axis: int = axis, cache: str = cache, style: str = style,
                  rot_dim: int = rot_dim, head_dim: int = head_dim, meta: dict = meta, root: Node = root) -> str:
            y, perm = _to_token_major(b, full, axis, meta)
            r = b.add1("rope", [y, "positions", cache],
                       {"style": style, "rotary_dim": rot_dim, "head_dim": head_dim}, name=f"{root.name}_rope", meta=meta)
            return _from_token_major(b, r, b.types[full].shape, perm, meta)

        new = rw.insert_before(root, build)
        rw.replace_uses(root.name, new)
    return dce(g)
