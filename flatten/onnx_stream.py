"""A faithful ONNX import -> the flat token stream every other part of portlayer serves.

ONNX graphs take ``input_ids [batch, seq]`` (often ``attention_mask``, ``token_type_ids``,
``position_ids`` too) and build their attention masks and position ids inside the graph.
The stream form takes ``input_ids``/``positions [num_tokens]`` and one ``attention`` op per
layer sees the sequence boundaries. The rewrite binds batch = 1 and seq = num_tokens, the mask
to all-ones and token types to zeros, and then replaces what depends on the length only:

- an additive (or ``where``) attention mask is evaluated at several lengths and must be all
  zero (bidirectional) or exactly causal, else the import is refused;
- an integer [1, T] value equal to arange(T) at every length tried becomes ``positions``.

The rest is the usual raising (attention chains, rms_norm, rope, ...). Then ``verify`` runs the
stream graph on two packed sequences against the faithful graph on each alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from portlayer.flatten.ir import Dim, Graph, GraphBuilder, TensorType, normalize_dim, to_sympy
from portlayer.flatten.onnx_load import OnnxImportError
from portlayer.flatten.rewrite import Rewriter, dce

TOKENS = "num_tokens"
SAMPLE_LENGTHS = (1, 2, 3, 7, 16, 61, 256)
ROLES = {"input_ids": "ids", "attention_mask": "mask", "token_type_ids": "types", "position_ids": "positions"}


def _subst(d: Dim, mapping: dict[str, Any]) -> Dim:
    if isinstance(d, int):
        return d
    from portlayer.flatten.dims import symbol

    e = to_sympy(d).subs({symbol(k): (v if isinstance(v, int) else symbol(v)) for k, v in mapping.items()})
    return normalize_dim(e)


def _subst_attrs(attrs: dict[str, Any], mapping: dict[str, Any]) -> dict[str, Any]:
    out = dict(attrs)
    for key in ("shape",):
        if isinstance(out.get(key), list):
            out[key] = [_subst(d, mapping) for d in out[key]]
    for key in ("end",):
        if isinstance(out.get(key), str):
            out[key] = _subst(out[key], mapping)
    return out


def bind_stream_inputs(graph: Graph, where: str) -> Graph:
    """Stream inputs in, the ONNX inputs re-expressed from them, symbols batch -> 1, seq -> num_tokens."""
    roles: dict[str, str] = {}
    for v in graph.inputs:
        role = ROLES.get(v.name)
        if role is None:
            raise OnnxImportError(
                f"{where}: graph input {v.name!r} has no token-stream meaning (portlayer knows "
                f"{sorted(ROLES)}); import with stream=False to run the graph as it is")
        roles[role] = v.name
    if "ids" not in roles:
        raise OnnxImportError(f"{where}: no 'input_ids' graph input; the token stream needs token ids")
    ids_t = next(v.type for v in graph.inputs if v.name == roles["ids"])
    if ids_t.rank != 2:
        raise OnnxImportError(f"{where}: input_ids has shape {list(ids_t.shape)}; expected [batch, sequence]")
    mapping: dict[str, Any] = {}
    for d, to in zip(ids_t.shape, (1, TOKENS)):
        if isinstance(d, str):
            mapping[d] = to
        elif d != to and not (to == 1 and d == 1):
            raise OnnxImportError(f"{where}: input_ids has a fixed sequence length {d}; export it with a dynamic axis")
    b = GraphBuilder(Graph())
    ids = b.add_input("input_ids", TensorType("int64", (TOKENS,)))
    pos = b.add_input("positions", TensorType("int64", (TOKENS,)))
    env: dict[str, str] = {}
    for v in graph.inputs:
        role = [r for r, n in roles.items() if n == v.name][0]
        meta = {"source": f"onnx input {v.name}"}
        if role in ("ids", "positions"):
            src = b.add1("reshape", [ids if role == "ids" else pos], {"shape": [1, TOKENS]}, name=f"{v.name}_2d", meta=meta)
            env[v.name] = src if v.type.dtype == "int64" else b.add1("cast", [src], {"dtype": v.type.dtype}, meta=meta)
        else:
            env[v.name] = b.add1("full", [], {"shape": [1, TOKENS], "value": 1 if role == "mask" else 0,
                                             "dtype": v.type.dtype}, name=f"{v.name}_const", meta=meta)
    for name, t in graph.params.items():
        b.graph.params[name] = t
        b.graph.weights[name] = graph.weights[name]
        b.types[name] = t
        env[name] = name
    for n in graph.nodes:
        outs = b.add(n.op, [env[i] if i else None for i in n.inputs], _subst_attrs(n.attrs, mapping), name=n.name,
                     meta=n.meta)
        for v, o in zip(n.outputs, outs):
            env[v.name] = o
    outs = []
    for o in graph.outputs:  # [1, num_tokens, ...] -> [num_tokens, ...]: the stream has no batch axis
        t = b.types[env[o]]
        if t.rank >= 2 and t.shape[0] == 1 and t.shape[1] == TOKENS:
            src = next((n.meta for n in reversed(b.graph.nodes) if n.outputs[0].name == env[o]), {})
            outs.append(b.add1("reshape", [env[o]], {"shape": list(t.shape[1:])}, name=f"{o}_stream", meta=dict(src)))
        else:
            outs.append(env[o])
    b.graph.outputs = outs
    b.graph.meta = dict(graph.meta)
    return b.graph


def _data_dependent(g: Graph) -> set[str]:
    dep = {v.name for v in g.inputs}
    for n in g.nodes:
        if any(i in dep for i in n.inputs if i):
            dep.update(o.name for o in n.outputs)
    return dep


def evaluate_length_only(g: Graph, values: list[str], lengths: Iterable[int]) -> dict[int, list[torch.Tensor]]:
    """Values that depend on the token count only, evaluated at each length."""
    from portlayer.flatten.interpret import ExecContext, run_graph

    need = set(values)
    keep = []
    for n in reversed(g.nodes):
        if any(o.name in need for o in n.outputs):
            keep.append(n)
            need.update(i for i in n.inputs if i)
    sub = Graph()
    sub.nodes = list(reversed(keep))
    sub.params = {k: v for k, v in g.params.items() if k in need}
    sub.weights = {k: v for k, v in g.weights.items() if k in need}
    sub.outputs = list(values)
    return {t: run_graph(sub, {}, ExecContext(bindings={TOKENS: t, "num_seqs": 1})) for t in lengths}


def _mask_kind(m: torch.Tensor, t: int, additive: bool) -> str | None:
    """'none' or 'causal' for a mask evaluated at length t (broadcast to [.., t, t])."""
    m = m.reshape(-1, *m.shape[-2:]) if m.dim() >= 2 else m.reshape(1, 1, -1)
    m = m.expand(m.shape[0], t, t) if m.shape[-2:] != (t, t) else m
    keep = (m == 0) if additive else m.bool()
    if not additive and m.dtype != torch.bool:
        return None
    if additive and not bool(((m == 0) | (m <= -1e4)).all()):
        return None
    tri = torch.ones(t, t, dtype=torch.bool).tril()
    if bool(keep.all()):
        return "none"
    if bool((keep == tri).all()):
        return "causal"
    return None


def fold_masks(g: Graph, where: str) -> tuple[Graph, set[str]]:
    """Remove length-only masks in front of softmax; returns the graph and the causal softmaxes."""
    g = g.copy()
    rw = Rewriter(g)
    dep = _data_dependent(g)
    causal: set[str] = set()
    seen: dict[tuple[str, bool], set[str | None]] = {}
    for sm in [n for n in g.nodes if n.op == "softmax"]:
        cur = rw.producer(sm.inputs[0])
        while cur is not None:
            if cur.op == "add" and len(cur.inputs) == 2 and cur.inputs[1] is not None:
                a, b = cur.inputs
                mask, scores = (b, a) if b not in dep else (a, b) if a not in dep else (None, None)
                additive = True
            elif cur.op == "where" and cur.inputs[0] not in dep and cur.inputs[1] in dep and len(cur.inputs) > 2 \
                    and cur.inputs[2] is None and (cur.attrs.get("y_scalar") or 0) <= -1e4:
                mask, scores, additive = cur.inputs[0], cur.inputs[1], False
            else:
                break
            if mask is None:
                break
            if (mask, additive) not in seen:  # layers share one mask: evaluated once
                vals = evaluate_length_only(g, [mask], SAMPLE_LENGTHS)
                seen[(mask, additive)] = {_mask_kind(v[0], t, additive) for t, v in vals.items() if t > 1}
            kinds = seen[(mask, additive)]  # at 1 token causal and bidirectional agree, so it is not asked
            if len(kinds) != 1 or None in kinds:
                raise OnnxImportError(
                    f"{where}: the attention mask feeding {sm.name} (node {cur.name}, {sm.meta.get('source')}) is "
                    "neither bidirectional nor causal at every length tried; portlayer's attention op cannot express "
                    "it (import with stream=False to run the graph as it is)")
            if kinds == {"causal"}:
                causal.add(sm.name)
            rw.replace_uses(cur.outputs[0].name, scores)
            cur = rw.producer(scores)
    g = dce(g)
    # where(isnan(p), 0, p) after a softmax whose rows are never fully masked is p itself
    rw = Rewriter(g)
    for n in list(g.nodes):
        if n.op == "where" and len(n.inputs) == 3 and n.inputs[1] is None and n.inputs[2] is not None:
            c, p = rw.producer(n.inputs[0]), rw.producer(n.inputs[2])
            if c is not None and c.op == "ne" and c.inputs[0] == c.inputs[1] == n.inputs[2] and p is not None \
                    and p.op == "softmax":
                rw.replace_uses(n.outputs[0].name, n.inputs[2])
    return dce(g), causal


def replace_positions(g: Graph) -> Graph:
    """Integer length-only values equal to arange(T) (shape [T] or [1, T]) become ``positions``."""
    g = g.copy()
    rw = Rewriter(g)
    dep = _data_dependent(g)
    cands = [o.name for n in g.nodes for o in n.outputs if o.name not in dep and o.type.dtype in ("int64", "int32")
             and list(o.type.shape) in ([TOKENS], [1, TOKENS])]
    if not cands:
        return g
    vals = evaluate_length_only(g, cands, SAMPLE_LENGTHS)
    done: set[str] = set()
    for k, c in enumerate(cands):
        if not all(torch.equal(v[k].reshape(-1).long(), torch.arange(t)) for t, v in vals.items()):
            continue
        if any(i in done for i in (rw.producer(c).inputs if rw.producer(c) else []) if i):
            continue
        node = rw.producer(c)
        t = rw.type(c)

        def build(b: GraphBuilder, t=t, c=c) -> str:
            p = b.add1("reshape", ["positions"], {"shape": list(t.shape)}, name=f"{c}_positions")
            return p if t.dtype == "int64" else b.add1("cast", [p], {"dtype": t.dtype}, name=f"{c}_cast")

        rw.replace_uses(c, rw.insert_before(node, build))
        done.add(c)
    return dce(g)


def to_token_stream(graph: Graph, *, verify: bool = True, where: str = "<model>") -> Graph:
    """The faithful import rewritten to the token stream, raised to portable ops, checked."""
    from portlayer.flatten.onnx_attention import raise_onnx_attention
    from portlayer.flatten.onnx_facts import graph_facts
    from portlayer.flatten.patterns import raise_patterns

    g = bind_stream_inputs(graph, where)
    g, causal = fold_masks(g, where)
    g = replace_positions(g)
    g = raise_onnx_attention(g, causal)
    left = [n.name for n in g.nodes if n.name in causal]
    if left:
        raise OnnxImportError(f"{where}: causal attention at {left} did not match the attention pattern "
                              "(softmax(q @ k^T * scale) @ v over [batch, heads, seq, head_dim])")
    g = raise_patterns(g)
    g.meta.update(graph_facts(g))
    g.meta["token_symbol"] = TOKENS
    if verify:
        from portlayer.flatten.onnx_verify import check_stream

        check_stream(graph, g, where)
    return g
