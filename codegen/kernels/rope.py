"""Rotary embedding of q and k in one launch (neox or GPT-J pairing, partial rotary)."""

from __future__ import annotations

from typing import Any

from portlayer.codegen.expr import Unsupported
from portlayer.codegen.kernels.context import GenContext, GroupCode, host_numel, make_kernel, round_dtype
from portlayer.codegen.spec import Param, pow2, ptr, short_dtype


def build_rope(ctx: GenContext, group: dict[str, Any]) -> GroupCode:
    nodes = [ctx.nodes[n] for n in group["nodes"]]
    if not 1 <= len(nodes) <= 2 or any(n.op != "rope" for n in nodes):
        raise Unsupported(f"rope group {group['name']} must hold one or two rope nodes")
    q, k = nodes[0], nodes[-1]
    q_t, k_t = ctx.types[q.inputs[0]], ctx.types[k.inputs[0]]
    style, rot = q.attrs["style"], int(q.attrs["rotary_dim"])
    d = int(q_t.shape[-1])
    if q_t.rank != 3 or int(k_t.shape[-1]) != d or rot % 2:
        raise Unsupported("rope wants [T, H, D] inputs with an even rotary_dim")
    hq, hk = int(q_t.shape[1]), (int(k_t.shape[1]) if len(nodes) == 2 else 0)
    partial = rot < d
    cfg = ctx.cfg("rope")
    const = {"HQ": hq, "HK": hk, "D": d, "ROT": rot, "BLOCK_H": pow2(max(hq, hk)), "BLOCK_D": pow2(rot // 2)}
    if partial:
        const["BLOCK_PASS"] = pow2(d - rot)
    dt = q_t.dtype
    params = [Param("q_ptr", ptr(dt)), Param("k_ptr", ptr(k_t.dtype)), Param("pos_ptr", ptr(ctx.types[q.inputs[1]].dtype)),
              Param("cache_ptr", ptr(ctx.types[q.inputs[2]].dtype)), Param("q_out_ptr", ptr(dt)),
              Param("k_out_ptr", ptr(k_t.dtype)), Param("n_tokens", "i32")] + [Param(c, "constexpr") for c in const]
    spec = make_kernel("triton/rope.py.j2", "rope", f"{style}{'_partial' if partial else ''}_{short_dtype(dt)}", params,
                       const, cfg["num_warps"], doc=f"Rotary embedding ({style}) of q and k.",
                       node_names=[n.name for n in nodes], style=style, partial=partial, HQ=hq, HK=hk,
                       round_dtype=round_dtype(dt))
    n = host_numel(q_t.shape[:1])
    k_in, k_out = (k.inputs[0], k.outputs[0].name) if len(nodes) == 2 else (q.inputs[0], q.outputs[0].name)
    consts = ", ".join(f"{c}={v}" for c, v in const.items())
    line = (f"K.{spec.name}[({n},)]({q.inputs[0]}, {k_in}, {q.inputs[1]}, {q.inputs[2]}, {q.outputs[0].name}, "
            f"{k_out}, {n}, {consts}, num_warps={cfg['num_warps']})")
    return GroupCode([spec], [line], [n.outputs[0].name for n in nodes])
