"""mla_attention on Triton: the latent cache read by the paged attention kernels in their MQA form.

With weight absorption, MLA is multi-query attention over the cache entries themselves: each
head's query becomes q' = [q_nope @ W_UK[h] ++ q_pe] (kv_lora_rank + rope wide), the one shared
key of a token is its cache entry e = [c ++ k_pe], its value is the same entry (the output's
first kv_lora_rank columns are o_lat = sum_j p_j c_j), and out[h] = o_lat @ W_UV[h]^T. So the
group writes e with the reshape_and_cache kernel (key and value rows are the same entry), runs
the paged prefill / split-K decode kernels of codegen/kernels/attention.py with one KV head and
the cache as both K and V, and does the two absorptions as torch einsums on the device.
Prefill uses the absorbed form too (correct; more FLOPs per (query, key) pair than expanding
when the prompt is long: kv_lora_rank + rope instead of nope + rope).
"""

from __future__ import annotations

import math

from portlayer.codegen.kernels.attention import (
    build_cache_write,
    build_decode,
    build_prefill,
    constexpr_args,
    decode_lines,
    prefill_lines,
)
from portlayer.codegen.kernels.context import GenContext
from portlayer.codegen.lowering import GroupCode, KernelGroup
from portlayer.flatten.ir import Node, TensorType, Value


def mqa_node(ctx: GenContext, node: Node) -> Node:
    """The attention node the kernels see: q' [T, H, rank + rope] against one KV head of entries."""
    a = node.attrs
    h, r, dn, dr = (int(a[k]) for k in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"))
    q_t = ctx.types[node.inputs[0]]
    q_name, e_name = f"{node.name}__mla_q", f"{node.name}__mla_e"
    ctx.types[q_name] = TensorType(q_t.dtype, (q_t.shape[0], h, r + dr))
    ctx.types[e_name] = TensorType(ctx.types[node.inputs[1]].dtype, (q_t.shape[0], 1, r + dr))
    scale = float(a["scale"]) if a.get("scale") is not None else 1.0 / math.sqrt(dn + dr)
    return Node(f"{node.name}__mqa", "attention", [q_name, e_name, e_name],
                [Value(f"{node.name}__mla_o", TensorType(q_t.dtype, (q_t.shape[0], h, r + dr)))],
                {"num_heads": h, "num_kv_heads": 1, "head_dim": r + dr, "scale": scale, "causal": True,
                 "layer": int(a.get("layer", 0))})


def lower_mla(ctx: GenContext, group: KernelGroup) -> GroupCode:
    (node,) = group.nodes
    q, lat, pe, w = node.inputs
    out = node.outputs[0].name
    a = node.attrs
    h, r, dn, dr, dv = (int(a[k]) for k in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                             "v_head_dim"))
    mqa = mqa_node(ctx, node)
    cache, row, block, cw = build_cache_write(ctx, mqa)
    pre, pconst, c, pcfg = build_prefill(ctx, mqa, paged=True)
    dense, dconst, _, _ = build_prefill(ctx, mqa, paged=False)
    dec, red, kconst, _, kcfg = build_decode(ctx, mqa)

    s = repr(c["scale"])
    layer = int(a.get("layer", 0))
    lines = [
        f"# MLA, latent cache of {r} + {dr} per token; {h} heads absorbed into one KV head (MQA over the entries)",
        f"mla_w = {w}.view({h}, {dn + dv}, {r})",
        f"mla_q = torch.cat([torch.einsum('thd,hdr->thr', {q}[..., :{dn}], mla_w[:, :{dn}]), {q}[..., {dn}:]], "
        "dim=-1).contiguous()",
        f"mla_e = torch.cat([{lat}, {pe}], dim=-1).view(T, 1, {r + dr}).contiguous()",
        f"mla_o = torch.empty(T, {h}, {r + dr}, dtype={q}.dtype, device={q}.device)",
        "if st.paged:",
        f"    k_cache, v_cache = {ctx.kv_cache_expr(layer)}",
        "    if st.slot_mapping is not None:",
        f"        K.{cache.name}[(T,)](mla_e, mla_e, k_cache, k_cache, st.slot_mapping, T, ROW={row}, BLOCK={block}, "
        f"num_warps={cw})",
        "    if st.num_prefills:",
        *prefill_lines(pre, pconst, pcfg, "mla_q", "k_cache", "k_cache", "mla_o", h, s),
        "    if st.num_decodes:",
        *decode_lines(ctx, dec, red, kconst, kcfg, "mla_q", "k_cache", "k_cache", "mla_o", 1, h, s),
        "else:",
        f"    K.{dense.name}[(triton.cdiv(st.max_query_len, {dconst['BLOCK_M']}), st.num_seqs, {h})](",
        f"        mla_q, mla_e, mla_e, mla_o, st.query_start_loc, {s}, {constexpr_args(dconst)},",
        f"        num_warps={pcfg['num_warps']}, num_stages={pcfg['num_stages']})",
        f"{out}.copy_(torch.einsum('thr,hvr->thv', mla_o[..., :{r}], mla_w[:, {dn}:]))  # through W_UV",
    ]
    code = GroupCode([cache, pre, dense, dec, red], lines, [out])
    code.kernels[-1].extra["scratch"] = (h, kconst["NUM_SPLITS"], c["BLOCK_D"])
    return code
