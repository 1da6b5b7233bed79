"""Raise the attention chains ONNX exporters write to the portable ``attention`` op.

Exporters decompose attention as ``softmax((q * s1) @ (k^T * s2) [* s3]) @ v`` over head-major
``[batch, heads, seq, head_dim]`` values, the scale often split between q and k, k transposed
by a Transpose, GQA by an Unsqueeze/Expand/Reshape repeat. Masks were folded before
(onnx_stream.fold_masks), so what is left is exactly that chain; the op takes token-major
``[T, H, D]``. Runs on the batch-1 graph before the unit batch axis is squeezed.
"""

from __future__ import annotations

import math

from portlayer.flatten.ir import Dim, Graph, GraphBuilder
from portlayer.flatten.rewrite import Rewriter, dce


def _nonunit(shape: tuple[Dim, ...]) -> list[Dim]:
    return [d for d in shape if d != 1]


def _strip(rw: Rewriter, v: str) -> tuple[str, float]:
    """Walk back through scalar mul/div and unit-axis reshapes; returns the source and the scale."""
    scale = 1.0
    while True:
        p = rw.producer(v)
        if p is None:
            return v, scale
        if p.op in ("mul", "div") and p.attrs.get("scalar") is not None and (len(p.inputs) < 2 or p.inputs[1] is None) \
                and not p.attrs.get("reverse"):
            s = float(p.attrs["scalar"])
            scale *= s if p.op == "mul" else 1.0 / s
            v = p.inputs[0]
        elif p.op == "reshape" and _nonunit(rw.type(p.inputs[0]).shape) == _nonunit(rw.type(v).shape):
            v = p.inputs[0]
        else:
            return v, scale


def _swap_last(rw: Rewriter, v: str) -> str | None:
    """x when v is x with its last two axes swapped (Transpose / permute), else None."""
    p = rw.producer(v)
    if p is None:
        return None
    r = rw.type(v).rank
    if p.op == "permute" and list(p.attrs["dims"]) == list(range(r - 2)) + [r - 1, r - 2]:
        return p.inputs[0]
    if p.op == "transpose" and {p.attrs["dim0"] % r, p.attrs["dim1"] % r} == {r - 1, r - 2}:
        return p.inputs[0]
    return None


def _unrepeat(rw: Rewriter, v: str, heads: int) -> tuple[str, int]:
    """HF repeat_kv (unsqueeze -> expand -> reshape) undone: (source [.., Hkv, T, D], Hkv)."""
    r = rw.producer(v)
    e = rw.producer(r.inputs[0]) if r is not None and r.op == "reshape" else None
    if e is None or e.op != "expand":
        return v, heads
    u = rw.producer(e.inputs[0])
    src = u.inputs[0] if u is not None and u.op == "reshape" else e.inputs[0]
    big, small = rw.type(e.outputs[0].name).shape, rw.type(src).shape
    if len(big) != len(small) + 1 or len(small) < 3 or rw.type(e.inputs[0]).shape[-3] != 1:
        return v, heads
    hkv, rep = small[-3], big[-3]
    if not isinstance(hkv, int) or not isinstance(rep, int) or hkv * rep != heads:
        return v, heads
    return src, hkv


def _head_major(rw: Rewriter, v: str, h: int, t: Dim, d: int) -> bool:
    return _nonunit(rw.type(v).shape) == _nonunit((h, t, d))


def raise_onnx_attention(graph: Graph, causal_softmax: set[str]) -> Graph:
    g = graph.copy()
    rw = Rewriter(g)
    for out in [n for n in g.nodes if n.op == "matmul"]:
        if out.name not in rw.index:
            continue
        sm = rw.producer(out.inputs[0])
        if sm is None or sm.op != "softmax" or sm.attrs["dim"] % rw.type(sm.name).rank != rw.type(sm.name).rank - 1:
            continue
        scores, s0 = _strip(rw, sm.inputs[0])
        mm = rw.producer(scores)
        if mm is None or mm.op != "matmul":
            continue
        shp = rw.type(mm.outputs[0].name).shape
        if len(shp) < 3 or any(d != 1 for d in shp[:-3]) or not isinstance(shp[-3], int) or shp[-2] != shp[-1]:
            continue
        heads, t = shp[-3], shp[-2]
        q, s1 = _strip(rw, mm.inputs[0])
        kt, s2 = _strip(rw, mm.inputs[1])
        d = rw.type(mm.inputs[0]).shape[-1]
        k_hm = _swap_last(rw, kt)
        if k_hm is not None:
            k_hm, s3 = _strip(rw, k_hm)
            s2 *= s3
        v, s4 = _strip(rw, out.inputs[1])
        if s4 != 1.0 or not isinstance(d, int):
            continue
        dv = rw.type(out.inputs[1]).shape[-1]
        if not _head_major(rw, q, heads, t, d) or not isinstance(dv, int):
            continue
        k_dt = k_hm is None  # k arrives as [.., H, D, T] straight from its own permute
        if k_dt:
            k_src, hkv = kt, heads
            v_src = v
            if _nonunit(rw.type(kt).shape) != _nonunit((heads, d, t)):
                continue
        else:
            k_src, hkv = _unrepeat(rw, k_hm, heads)
            v_src, hkv_v = _unrepeat(rw, v, heads)
            if hkv != hkv_v:
                k_src, v_src, hkv = k_hm, v, heads
            if not _head_major(rw, k_src, hkv, t, d):
                continue
        if not _head_major(rw, v_src, hkv, t, dv):
            continue
        scale = s0 * s1 * s2
        if math.isclose(scale, 1 / math.sqrt(d), rel_tol=1e-6):
            scale = 1 / math.sqrt(d)
        out_shape = list(rw.type(out.outputs[0].name).shape)

        def build(b: GraphBuilder, q=q, k=k_src, v=v_src, hkv=hkv, heads=heads, t=t, d=d, dv=dv, scale=scale,
                  out=out, out_shape=out_shape, causal=sm.name in causal_softmax, k_dt=k_dt) -> str:
            meta = dict(out.meta)

            def token_major(x: str, h: int, w: int, dt: bool = False) -> str:
                r = b.add1("reshape", [x], {"shape": [h, w, t] if dt else [h, t, w]}, name=f"{x}_hd", meta=meta)
                return b.add1("permute", [r], {"dims": [2, 0, 1] if dt else [1, 0, 2]}, name=f"{x}_thd", meta=meta)

            a = b.add1("attention", [token_major(q, heads, d), token_major(k, hkv, d, k_dt), token_major(v, hkv, dv)], {
                "num_heads": heads, "num_kv_heads": hkv, "head_dim": d, "scale": scale, "causal": causal,
                "layer": 0}, name=f"{out.name}_attention", meta=meta)
            hm = b.add1("permute", [a], {"dims": [1, 0, 2]}, name=f"{a}_hm", meta=meta)
            return b.add1("reshape", [hm], {"shape": out_shape}, name=f"{a}_out", meta=meta)

        rw.replace_uses(out.outputs[0].name, rw.insert_before(out, build))
    g = dce(g)
    for i, n in enumerate(n for n in g.nodes if n.op == "attention"):
        n.attrs["layer"] = i
    return g
