"""Rotary embedding of q and k in one launch (neox or GPT-J pairing, partial rotary), with
optional per-head rms_norm prologues (Qwen3's q_norm / k_norm) fused in front."""

from __future__ import annotations

from portlayer.codegen.expr import Unsupported
from portlayer.codegen.kernels.attention import is_fp8
from portlayer.codegen.kernels.context import GenContext, host_numel, make_kernel, round_dtype
from portlayer.codegen.lowering import GroupCode, GroupQuery, KernelGroup, Unlowerable
from portlayer.codegen.spec import Param, pow2, ptr, short_dtype
from portlayer.flatten.ir import Node


def _split(nodes: list[Node]) -> tuple[list[Node], dict[str, Node]]:
    """(the one or two ropes, rope name -> the per-head rms_norm feeding its x)."""
    ropes = [n for n in nodes if n.op == "rope"]
    if not 1 <= len(ropes) <= 2:
        raise Unsupported("the rope kernel rotates one or two tensors (q and k)")
    made = {n.outputs[0].name: n for n in nodes if n.op != "rope"}
    norms: dict[str, Node] = {}
    for r in ropes:
        p = made.get(r.inputs[0])
        if p is not None:
            if p.op != "rms_norm":
                raise Unsupported(f"the rope kernel takes only a per-head rms_norm prologue, not {p.op}")
            norms[r.name] = p
    others = [n for n in nodes if n.op != "rope" and n not in norms.values()]
    if others:
        raise Unsupported(f"{others[0].name} ({others[0].op}) is neither a rope nor the rms_norm feeding one")
    if len(ropes) == 2 and (ropes[0].inputs[1:] != ropes[1].inputs[1:] or ropes[0].attrs != ropes[1].attrs):
        raise Unsupported("the two ropes use different positions, tables or attrs")
    return ropes, norms


def accepts_rope(query: GroupQuery, nodes: list[Node]) -> tuple[bool, str]:
    """q/k ropes sharing positions and table, [T, H, D] with even rotary_dim; a prologue is a per-head
    rms_norm over D (with a weight of D or none) read by nothing outside the kernel."""
    try:
        ropes, norms = _split(nodes)
    except Unsupported as e:
        return False, str(e)
    members = {n.name for n in nodes}
    for r in ropes:
        t = query.types[r.inputs[0]]
        if t.rank != 3 or not isinstance(t.shape[-1], int) or not isinstance(t.shape[1], int):
            return False, f"{r.name} rotates {t}, not a [T, H, D] tensor with static H and D"
        if int(r.attrs.get("rotary_dim", 0)) % 2:
            return False, f"rotary_dim {r.attrs.get('rotary_dim')} is odd"
        if r.attrs.get("style") not in ("neox", "gptj"):
            return False, f"rope style {r.attrs.get('style')!r} has no template"
        n = norms.get(r.name)
        if n is None:
            continue
        x = query.types[n.inputs[0]]
        w = n.inputs[1] if len(n.inputs) > 1 else None
        if x.shape != t.shape or (w is not None and tuple(query.types[w].shape) != (t.shape[-1],)):
            return False, f"{n.name} is not a per-head rms_norm over the head dim of {r.name}'s input"
        if query.used_outside(n.outputs[0].name, members):
            return False, f"{n.outputs[0].name} is read outside the kernel, which stores only the rotated heads"
    if len(ropes) == 2:
        a, b = (query.types[r.inputs[0]] for r in ropes)
        if a.shape[-1] != b.shape[-1]:
            return False, "q and k head dims differ"
    return True, ""


def build_rope(ctx: GenContext, group: KernelGroup) -> GroupCode:
    ropes, norms = _split(group.nodes)
    q, k = ropes[0], ropes[-1]
    qn, kn = norms.get(q.name), (norms.get(k.name) if len(ropes) == 2 else None)
    q_in = qn.inputs[0] if qn else q.inputs[0]
    k_in = (kn.inputs[0] if kn else k.inputs[0]) if len(ropes) == 2 else q_in
    q_t, k_t = ctx.types[q.inputs[0]], ctx.types[k.inputs[0]]
    style, rot = q.attrs["style"], int(q.attrs["rotary_dim"])
    d = int(q_t.shape[-1])
    hq, hk = int(q_t.shape[1]), (int(k_t.shape[1]) if len(ropes) == 2 else 0)
    partial = rot < d
    cfg = ctx.cfg("rope")
    const = {"HQ": hq, "HK": hk, "D": d, "ROT": rot, "BLOCK_H": pow2(max(hq, hk)), "BLOCK_D": pow2(rot // 2)}
    if partial:
        const["BLOCK_PASS"] = pow2(d - rot)
    dt = q_t.dtype
    norm_of = {"q": qn, "k": kn}
    params = [Param("q_ptr", ptr(ctx.types[q_in].dtype)), Param("k_ptr", ptr(ctx.types[k_in].dtype)),
              Param("pos_ptr", ptr(ctx.types[q.inputs[1]].dtype)), Param("cache_ptr", ptr(ctx.types[q.inputs[2]].dtype))]
    args = [q_in, k_in, q.inputs[1], q.inputs[2]]
    eps = {}
    for side, n in norm_of.items():
        if n is None:
            continue
        eps[side] = float(n.attrs.get("eps", 1e-6))
        w = n.inputs[1] if len(n.inputs) > 1 else None
        if w is not None:
            params.append(Param(f"{side}_w_ptr", ptr(ctx.types[w].dtype)))
            args.append(w)
    params += [Param("q_out_ptr", ptr(dt)), Param("k_out_ptr", ptr(k_t.dtype)), Param("n_tokens", "i32")]
    params += [Param(f"{s}_eps", "fp32") for s in eps] + [Param(c, "constexpr") for c in const]
    norm_cfg = {s: {"weight": len(n.inputs) > 1 and n.inputs[1] is not None,
                    "offset": float(n.attrs.get("weight_offset") or 0.0)} for s, n in norm_of.items() if n is not None}
    variant = ("norm_" if norm_cfg else "") + f"{style}{'_partial' if partial else ''}_{short_dtype(dt)}"
    doc = f"Rotary embedding ({style}) of q and k{' after their per-head rms_norm' if norm_cfg else ''}"
    spec = make_kernel("triton/rope.py.j2", "rope", variant, params, const, cfg["num_warps"], doc=doc + ".",
                       style=style, partial=partial, norms=norm_cfg, round_dtype=round_dtype(dt), kv_write=False,
                       kv_fp8=False)
    n = host_numel(q_t.shape[:1])
    k_out = k.outputs[0].name if len(ropes) == 2 else q.outputs[0].name
    consts = ", ".join(f"{c}={v}" for c, v in const.items())
    eps_args = "".join(f", {v!r}" for v in eps.values())
    line = (f"K.{spec.name}[({n},)]({', '.join(args)}, {q.outputs[0].name}, {k_out}, {n}{eps_args}, {consts}, "
            f"num_warps={cfg['num_warps']})")
    kv = group.record.get("kv_write")
    if not kv:
        return GroupCode([spec], [line], [r.outputs[0].name for r in ropes])
    # The fuse pass gave this kernel the attention's cache write (passes/fuse_kv.py).
    v = kv["v"]
    if len(ropes) != 2 or int(ctx.types[v].shape[1]) != hk or int(ctx.types[v].shape[2]) != d:
        raise Unlowerable(f"group {group.name}: the KV write wants V [T, {hk}, {d}] beside q/k ropes, got {ctx.types[v]}")
    at = params.index(next(p for p in params if p.name == "q_out_ptr"))
    kc, vc = ctx.cache_dtype(k_t.dtype), ctx.cache_dtype(ctx.types[v].dtype)
    kv_params = [*params[:at], Param("v_ptr", ptr(ctx.types[v].dtype)), Param("k_cache_ptr", ptr(kc)),
                 Param("v_cache_ptr", ptr(vc)), Param("slot_mapping_ptr", "*i64"), *params[at:],
                 Param("BLOCK_V", "constexpr")]
    kv_const = {**const, "BLOCK_V": pow2(d)}
    kspec = make_kernel("triton/rope.py.j2", "rope", "kv_" + variant, kv_params, kv_const, cfg["num_warps"],
                        doc=doc + ", writing K and V into the paged cache.", style=style, partial=partial,
                        norms=norm_cfg, round_dtype=round_dtype(dt), kv_write=True, kv_fp8=is_fp8(kc))
    kv_line = (f"K.{kspec.name}[({n},)]({', '.join(args)}, {v}, k_cache, v_cache, st.slot_mapping, {q.outputs[0].name}, "
               f"{k_out}, {n}{eps_args}, {consts}, BLOCK_V={pow2(d)}, num_warps={cfg['num_warps']})")
    lines = ["if st.paged and st.slot_mapping is not None:  # fuse: this kernel writes the KV cache (attention reads it)",
             f"    k_cache, v_cache = {ctx.kv_cache_expr(int(kv['layer']))}", f"    {kv_line}", "else:", f"    {line}"]
    return GroupCode([spec, kspec], lines, [r.outputs[0].name for r in ropes])
