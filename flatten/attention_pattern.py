"""Raise explicit attention chains to the attention op.

Models captured through the HF hook already arrive with one attention op per layer; this
covers graphs from elsewhere (hand-written modules, ONNX, modeling code that computes
``softmax(q @ k^T * scale) @ v`` itself). It matches the unmasked (bidirectional) form with
the scale applied to the scores or to q, folds HF's ``repeat_kv`` (unsqueeze → expand →
reshape) into the op's GQA group size, and converts the head-major [.., H, T, D] layout to the
op's token-major [T, H, D]. Masked chains are left alone: their mask would have to be proven
causal first, and leaving them is always correct.
"""

from __future__ import annotations

import math

from portlayer.flatten.ir import Graph, GraphBuilder, Node
from portlayer.flatten.rewrite import Rewriter, dce


def _scalar_of(n: Node) -> float | None:
    if n.op in ("mul", "div") and n.attrs.get("scalar") is not None and (len(n.inputs) < 2 or n.inputs[1] is None):
        s = float(n.attrs["scalar"])
        return s if n.op == "mul" else 1.0 / s
    return None


def _unrepeat(rw: Rewriter, v: str) -> tuple[str, int]:
    """k after repeat_kv -> (k before, n_rep); (v, 1) when v is not a repeat."""
    r = rw.producer(v)
    if r is None or r.op != "reshape":
        return v, 1
    e = rw.producer(r.inputs[0])
    if e is None or e.op != "expand":
        return v, 1
    u = rw.producer(e.inputs[0])
    if u is None or u.op != "reshape":
        return v, 1
    src = u.inputs[0]
    s, big = rw.type(src).shape, rw.type(e.name).shape
    # src [.., Hkv, T, D] -> [.., Hkv, 1, T, D] -> [.., Hkv, n, T, D] -> [.., Hkv*n, T, D]
    if len(big) != len(s) + 1 or rw.type(u.name).shape[-3] != 1:
        return v, 1
    n = big[-3]
    if not isinstance(n, int):
        return v, 1
    return src, n


def _head_major(rw: Rewriter, v: str) -> bool:
    t = rw.type(v).shape
    return len(t) >= 3 and all(d == 1 for d in t[:-3]) and isinstance(t[-3], int) and isinstance(t[-1], int)


def raise_attention_chains(graph: Graph) -> Graph:
    """softmax(q @ k^T * scale) @ v  ->  attention(q, k, v, causal=False, scale)."""
    g = graph.copy()
    rw = Rewriter(g)
    layer = sum(1 for n in g.nodes if n.op == "attention")
    for out in [n for n in g.nodes if n.op == "matmul"]:
        if out.name not in rw.index:
            continue
        sm = rw.producer(out.inputs[0])
        if sm is None or sm.op != "softmax" or sm.attrs["dim"] not in (-1, rw.type(sm.name).rank - 1):
            continue
        scale, cur = 1.0, rw.producer(sm.inputs[0])
        while cur is not None and _scalar_of(cur) is not None:
            scale *= _scalar_of(cur)
            cur = rw.producer(cur.inputs[0])
        if cur is None or cur.op != "matmul":
            continue
        q, kt = cur.inputs[0], cur.inputs[1]
        qn = rw.producer(q)
        while qn is not None and _scalar_of(qn) is not None:  # scale folded into q
            scale *= _scalar_of(qn)
            q = qn.inputs[0]
            qn = rw.producer(q)
        tn = rw.producer(kt)
        rank = rw.type(kt).rank
        if tn is None or tn.op != "transpose" or {tn.attrs["dim0"] % rank, tn.attrs["dim1"] % rank} != {rank - 1, rank - 2}:
            continue
        k, rep_k = _unrepeat(rw, tn.inputs[0])
        v, rep_v = _unrepeat(rw, out.inputs[1])
        if rep_k != rep_v or not all(_head_major(rw, x) for x in (q, k, v)):
            continue
        qs, ks, vs = rw.type(q).shape, rw.type(k).shape, rw.type(v).shape
        if qs[-2] != ks[-2] or ks[-2] != vs[-2]:
            continue  # cross attention / cached keys: not this pattern
        tokens = qs[-2]

        def build(b: GraphBuilder, q=q, k=k, v=v, scale=scale, out=out, tokens=tokens, qs=qs, ks=ks, vs=vs) -> str:
            meta = dict(out.meta)

            def token_major(val: str, shape) -> str:
                t = b.add1("transpose", [val], {"dim0": -3, "dim1": -2}, name=f"{val}_tm", meta=meta)
                return b.add1("reshape", [t], {"shape": [tokens, shape[-3], shape[-1]]}, name=f"{val}_thd", meta=meta)

            a = b.add1("attention", [token_major(q, qs), token_major(k, ks), token_major(v, vs)], {
                "num_heads": int(qs[-3]), "num_kv_heads": int(ks[-3]), "head_dim": int(qs[-1]),
                "scale": scale if not math.isclose(scale, 1 / math.sqrt(int(qs[-1]))) else 1 / math.sqrt(int(qs[-1])),
                "causal": False, "layer": 0}, name=f"{out.name}_attention", meta=meta)
            lead = list(qs[:-3])
            r = b.add1("reshape", [a], {"shape": lead + [tokens, qs[-3], vs[-1]]}, name=f"{a}_unflat", meta=meta)
            return b.add1("transpose", [r], {"dim0": -3, "dim1": -2}, name=f"{a}_hm", meta=meta)

        rw.replace_uses(out.name, rw.insert_before(out, build))
        layer += 1
    g = dce(g)
    for i, n in enumerate(n for n in g.nodes if n.op == "attention"):
        n.attrs["layer"] = i
    return g
