"""Raise DeepSeek's expanded multi-head latent attention to ``mla_attention`` (latent KV cache).

HF's DeepSeek-V2/V3 attention projects each token to a latent ``c`` (kv_lora_rank wide) and a
shared rotary key ``k_pe``, expands them with ``kv_b_proj`` into per-head keys and values, and
passes those to attention: captured as is, the KV cache would hold the expanded keys and values
(H x (nope + rope + v) per token). This pass finds, for every attention node, a value ``v`` that
is only data movement (slices, reshapes, transposes, concats, expands) of one bias-free linear
``kv = c @ W^T``, a key whose first ``nope`` dims are the same linear's other half, and a one-head
value ``k_pe`` that fills the rest of every head's key. It then *proves* the reading on the
captured graph itself — on random token ids, k == [kv[..., :nope] ++ k_pe] and v == kv[..., nope:]
bit for bit — and only then replaces each attention by ``mla_attention(q, c, k_pe, W)``, whose
cache stores c ++ k_pe (rank + rope per token). All attention layers or none: a graph where one
layer does not fit keeps the expanded form (correct, with the larger cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from portlayer.flatten.ir import Graph, GraphBuilder, Node
from portlayer.flatten.rewrite import Rewriter, dce

DATA_OPS = {"reshape", "transpose", "permute", "slice", "concat", "expand", "full", "unsqueeze", "squeeze",
            "contiguous", "clone"}


@dataclass
class _Plan:
    attn: Node
    weight: str
    latent: str
    kv: str
    nope: int
    rope: int
    v_dim: int
    candidates: list[str] = field(default_factory=list)
    k_pe: str | None = None


def _per_token(rw: Rewriter, value: str, tokens: str) -> int | None:
    """Elements per token of ``value`` (one token axis, all other dims static), else None."""
    shape = rw.type(value).shape
    if sum(1 for d in shape if d == tokens) != 1 or not all(isinstance(d, int) for d in shape if d != tokens):
        return None
    return math.prod(int(d) for d in shape if d != tokens)


def _cone(rw: Rewriter, value: str) -> tuple[list[str], set[str]]:
    """(values reached through data-movement ops only, nearest first; the leaves where it stops)."""
    seen, order, leaves, todo = set(), [], set(), [value]
    while todo:
        v = todo.pop(0)
        if v in seen:
            continue
        seen.add(v)
        n = rw.producer(v)
        if n is None or n.op not in DATA_OPS:
            leaves.add(v)
            continue
        order.append(v)
        todo += [i for i in n.inputs if i is not None]
    return order, leaves


def _depends_on(rw: Rewriter, value: str, target: str, memo: dict[str, bool]) -> bool:
    if value == target:
        return True
    if value not in memo:
        n = rw.producer(value)
        memo[value] = bool(n is not None and n.op in DATA_OPS
                           and any(_depends_on(rw, i, target, memo) for i in n.inputs if i is not None))
    return memo[value]


def _plan(rw: Rewriter, a: Node, tokens: str) -> _Plan | None:
    at = a.attrs
    if at.get("sliding_window") or at.get("softcap") or not at.get("causal", True):
        return None
    q, k, v = (rw.type(i) for i in a.inputs[:3])
    if not all(isinstance(d, int) for t in (q, k, v) for d in t.shape[1:]):
        return None
    h, dk, dv = int(k.shape[1]), int(k.shape[2]), int(v.shape[2])
    if int(q.shape[1]) != h or int(q.shape[2]) != dk:
        return None
    _, v_leaves = _cone(rw, a.inputs[2])
    v_leaves = {x for x in v_leaves if rw.producer(x) is not None}
    if len(v_leaves) != 1:
        return None
    (kv,) = v_leaves
    lin = rw.producer(kv)
    if lin.op != "linear" or (len(lin.inputs) > 2 and lin.inputs[2]) or lin.inputs[1] not in rw.g.params:
        return None
    w = rw.g.params[lin.inputs[1]]
    if w.rank != 2 or int(w.shape[0]) % h:
        return None
    nope = int(w.shape[0]) // h - dv
    rank = int(w.shape[1])
    if nope <= 0 or dk - nope <= 0 or _per_token(rw, lin.inputs[0], tokens) != rank:
        return None
    k_cone, k_leaves = _cone(rw, a.inputs[1])
    if kv not in k_leaves:
        return None
    memo: dict[str, bool] = {}
    cands = [x for x in k_cone if _per_token(rw, x, tokens) == dk - nope and not _depends_on(rw, x, kv, memo)]
    if not cands:
        return None
    return _Plan(a, lin.inputs[1], lin.inputs[0], kv, nope, dk - nope, dv, cands)


def _prove(graph: Graph, plans: list[_Plan]) -> bool:
    """Run the captured graph once on random ids and check the MLA reading of every layer exactly."""
    from portlayer.flatten.interpret import interpret

    probe = graph.copy()
    want = []
    for p in plans:
        want += [p.attn.inputs[1], p.attn.inputs[2], p.kv, p.latent, *p.candidates]
    probe.outputs = list(dict.fromkeys(want))
    vocab = next((int(graph.params[n.inputs[0]].shape[0]) for n in graph.nodes
                  if n.op == "embedding" and n.inputs[0] in graph.params), 2)
    try:
        vals = dict(zip(probe.outputs, interpret(probe, torch.randint(0, vocab, (7,),
                                                                      generator=torch.Generator().manual_seed(0)))))
    except Exception:  # noqa: BLE001 - a graph this reading does not fit keeps its expanded form
        return False
    for p in plans:
        k, v, kv = vals[p.attn.inputs[1]], vals[p.attn.inputs[2]], vals[p.kv]
        t, h = k.shape[0], k.shape[1]
        kv = kv.reshape(t, h, p.nope + p.v_dim)
        w = graph.weights[p.weight]
        lat = vals[p.latent].reshape(t, -1)
        if not (torch.equal(k[..., : p.nope], kv[..., : p.nope]) and torch.equal(v, kv[..., p.nope:])):
            return False
        if not torch.allclose(torch.nn.functional.linear(lat.float(), w.float()), kv.reshape(t, -1).float(),
                              rtol=1e-4, atol=1e-5):
            return False
        for c in p.candidates:
            pe = vals[c].reshape(t, 1, p.rope)
            if torch.equal(k[..., p.nope:], pe.expand(t, h, p.rope)):
                p.k_pe = c
                break
        if p.k_pe is None:
            return False
    return True


def raise_mla(graph: Graph) -> Graph:
    """Every attention layer to ``mla_attention`` where the model is MLA (proven), else unchanged."""
    attn = graph.find("attention")
    if not attn or graph.meta.get("task", "causal_lm") != "causal_lm":
        return graph
    rw = Rewriter(graph)
    tokens = rw.type(attn[0].inputs[0]).shape[0]
    plans = [_plan(rw, a, tokens) for a in attn]
    if any(p is None for p in plans) or not _prove(graph, plans):  # type: ignore[arg-type]
        return graph
    for p in plans:
        a = p.attn
        rank = int(graph.params[p.weight].shape[1])

        def build(b: GraphBuilder, p=p, a=a, rank=rank) -> str:
            meta = dict(a.meta)
            lat = b.add1("reshape", [p.latent], {"shape": [tokens, rank]}, name=f"{a.name}_latent", meta=meta)
            pe = b.add1("reshape", [p.k_pe], {"shape": [tokens, p.rope]}, name=f"{a.name}_k_pe", meta=meta)
            return b.add1("mla_attention", [a.inputs[0], lat, pe, p.weight], {
                "num_heads": int(a.attrs["num_heads"]), "kv_lora_rank": rank, "qk_nope_head_dim": p.nope,
                "qk_rope_head_dim": p.rope, "v_head_dim": p.v_dim, "scale": a.attrs.get("scale"),
                "layer": int(a.attrs.get("layer", 0))}, name=f"{a.name}_mla", meta=meta)

        rw.replace_uses(a.outputs[0].name, rw.insert_before(a, build))
    graph = dce(graph)
    p0 = plans[0]
    graph.meta.update({"num_kv_heads": 1, "head_dim": int(graph.params[p0.weight].shape[1]) + p0.rope,
                       "v_head_dim": 0, "kv_layout": "mla_latent"})
    return graph
