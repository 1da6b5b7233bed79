"""The attention group: write the new K/V into the paged cache, then paged prefill and
split-K decode kernels (or, without a cache, varlen attention over the stream)."""

from __future__ import annotations

import math
from typing import Any

from portlayer.codegen.expr import Unsupported
from portlayer.codegen.kernels.context import GenContext, dot_args, make_kernel
from portlayer.codegen.lowering import GroupCode, KernelGroup
from portlayer.codegen.spec import Param, pow2, ptr, short_dtype


def max_splits(compute_units: int, num_kv_heads: int) -> int:
    """The most KV splits a decode sequence may take (the scratch's width): enough programs to cover the compute
    units at batch 1. A step takes fewer (host_support.decode_splits) when its sequences fill the device."""
    return max(1, min(16, pow2(max(1, compute_units // max(1, num_kv_heads)))))


def constexpr_args(d: dict[str, Any], skip: tuple[str, ...] = ()) -> str:
    """``K=v, ...`` keyword arguments of a generated launch line (the BLOCK_SIZE a step passes left out by ``skip``)."""
    return ", ".join(f"{k}={v!r}" for k, v in d.items() if k not in skip)


def decode_block_n(cfg: dict[str, Any], block_d: int) -> int:
    """Tokens a decode-attention program reads a step: launch.attention_decode's TILE (elements of its K tile) over
    the head's padded width, a power of two in [16, 256] (16: tl.dot's smallest tile)."""
    return max(16, min(256, pow2(max(1, int(cfg["TILE"]) // block_d) + 1) // 2))


def _common(ctx: GenContext, node) -> dict[str, Any]:
    q_t, k_t, v_t = (ctx.types[i] for i in node.inputs[:3])
    hq, hkv, d = int(q_t.shape[1]), int(k_t.shape[1]), int(q_t.shape[2])
    if int(v_t.shape[2]) != d or hq % hkv:
        raise Unsupported("attention kernels want v's head_dim equal to q's and Hq a multiple of Hkv")
    a = node.attrs
    return {"HQ": hq, "HKV": hkv, "D": d, "GROUP": hq // hkv, "BLOCK_D": pow2(max(16, d)),
            "WINDOW": int(a.get("sliding_window") or 0), "SOFTCAP": float(a.get("softcap") or 0.0),
            "scale": float(a["scale"]) if a.get("scale") is not None else 1.0 / math.sqrt(d),
            "causal": bool(a.get("causal", True)), "dtype": q_t.dtype, "kv_dtype": k_t.dtype,
            "cache_dtype": ctx.cache_dtype(k_t.dtype)}


def upcast(compute: str) -> str:
    """What a float8 cache's values are read into for the dots (templates/triton/_kv_cache.j2): float16 at 16-bit
    compute (exact for every e4m3 value, the cheap conversion), else the compute dtype."""
    return "tl.float16" if compute in ("float16", "bfloat16") else "tl.float32"


def is_fp8(dtype: str) -> bool:
    """A float8 KV cache: its kernels round what they store and upcast what they load (templates/triton/_kv_cache.j2)."""
    return dtype.startswith("float8")


def build_prefill(ctx: GenContext, node, paged: bool):
    c = _common(ctx, node)
    cfg = ctx.cfg("attention_prefill")
    const = {k: c[k] for k in ("HQ", "HKV", "D", "GROUP")}
    const.update(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=c["BLOCK_D"])
    if paged:
        const["BLOCK_SIZE"] = ctx.kv_block_size  # binaries are compiled for the Plan's page size
    const.update(WINDOW=c["WINDOW"], SOFTCAP=c["SOFTCAP"])
    kv = c["cache_dtype"] if paged else c["kv_dtype"]  # paged: K/V come from the cache
    params = [Param("q_ptr", ptr(c["dtype"])), Param("k_ptr", ptr(kv)), Param("v_ptr", ptr(kv)),
              Param("out_ptr", ptr(c["dtype"]))]
    if paged:
        params += [Param("block_tables_ptr", "*i32"), Param("seq_lens_ptr", "*i32")]
    params.append(Param("query_start_ptr", "*i32"))
    if paged:
        params += [Param("bt_stride", "i32"), Param("num_seqs", "i32")]
    params += [Param("scale", "fp32")] + [Param(k, "constexpr") for k in const]
    mode = ("paged" if paged else "dense") + ("" if c["causal"] else "_bidir")
    spec = make_kernel("triton/attention_prefill.py.j2", "attn_prefill", f"{mode}_{short_dtype(c['dtype'])}", params,
                       const, cfg["num_warps"], cfg["num_stages"], doc="Varlen flash attention (prefill).",
                       paged=paged, causal=c["causal"], window=bool(c["WINDOW"]), softcap=bool(c["SOFTCAP"]),
                       dot_args=dot_args(c["dtype"]), even_d=c["BLOCK_D"] == c["D"],
                       kv_upcast=upcast(c["dtype"]) if paged and is_fp8(kv) else None)
    return spec, const, c, cfg


def build_decode(ctx: GenContext, node):
    c = _common(ctx, node)
    cfg = ctx.cfg("attention_decode")
    splits = max_splits(ctx.compute_units, c["HKV"])
    const = {k: c[k] for k in ("HQ", "HKV", "D", "GROUP")}
    const.update(BLOCK_SIZE=ctx.kv_block_size, BLOCK_H=max(16, pow2(c["GROUP"])),
                 BLOCK_N=decode_block_n(cfg, c["BLOCK_D"]), BLOCK_D=c["BLOCK_D"], NUM_SPLITS=splits,
                 WINDOW=c["WINDOW"], SOFTCAP=c["SOFTCAP"])
    kv = c["cache_dtype"]
    params = [Param("q_ptr", ptr(c["dtype"])), Param("k_cache_ptr", ptr(kv)), Param("v_cache_ptr", ptr(kv)),
              Param("block_tables_ptr", "*i32"), Param("seq_lens_ptr", "*i32"), Param("query_start_ptr", "*i32"),
              Param("part_out_ptr", "*fp32"), Param("part_max_ptr", "*fp32"), Param("part_sum_ptr", "*fp32"),
              Param("out_ptr", ptr(c["dtype"])), Param("seq_offset", "i32"), Param("bt_stride", "i32"),
              Param("num_splits", "i32"), Param("scale", "fp32")]
    params += [Param(k, "constexpr") for k in const]
    spec = make_kernel("triton/attention_decode.py.j2", "attn_decode", short_dtype(c["dtype"]), params, const,
                       cfg["num_warps"], cfg["num_stages"], doc="Split-K paged decode attention.",
                       GROUP=c["GROUP"], window=bool(c["WINDOW"]), softcap=bool(c["SOFTCAP"]),
                       dot_args=dot_args(c["dtype"]), kv_upcast=upcast(c["dtype"]) if is_fp8(kv) else None)
    reduce_const = {"HQ": c["HQ"], "D": c["D"], "BLOCK_D": c["BLOCK_D"], "NUM_SPLITS": splits}
    reduce_params = [Param("part_out_ptr", "*fp32"), Param("part_max_ptr", "*fp32"), Param("part_sum_ptr", "*fp32"),
                     Param("query_start_ptr", "*i32"), Param("out_ptr", ptr(c["dtype"])), Param("seq_offset", "i32"),
                     Param("num_splits", "i32")]
    reduce_params += [Param(k, "constexpr") for k in reduce_const]
    from portlayer.codegen.spec import KernelSpec

    reduce = KernelSpec(name=spec.name + "_reduce", family="attn_decode", source=spec.source, fn=spec.fn + "_reduce",
                        params=reduce_params, constexprs=reduce_const, num_warps=cfg["num_warps"],
                        doc="Merge of the split-K partial results.", extra={"module": spec.name})
    return spec, reduce, const, c, cfg


def decode_lines(ctx: GenContext, dec, red, kconst: dict[str, Any], kcfg: dict[str, Any], q: str, k_cache: str,
                 v_cache: str, out: str, kv_heads: int, q_heads: int, scale: str) -> list[str]:
    """The host lines of a step's decode attention (indented under ``if st.num_decodes:``): the splits for this
    many sequences (launch.attention_decode's PROGRAMS per compute unit, at most NUM_SPLITS; a CUDA graph of a
    batch replays the splits it was captured with), the split-K kernel, and its reduce when it split."""
    target = int(kcfg["PROGRAMS"]) * max(1, ctx.compute_units)
    consts, rconsts = constexpr_args(kconst, ("BLOCK_SIZE",)), constexpr_args(red.constexprs)
    return [
        f"        kv_splits = decode_splits(st.num_decodes, {kv_heads}, {target}, {kconst['NUM_SPLITS']})",
        f"        K.{dec.name}[(st.num_decodes, {kv_heads}, kv_splits)](",
        f"            {q}, {k_cache}, {v_cache}, st.block_tables, st.seq_lens, st.query_start_loc,",
        f"            self.part_out, self.part_max, self.part_sum, {out}, st.decode_offset, st.bt_stride, kv_splits, {scale},",
        f"            {consts}, BLOCK_SIZE=st.block_size,",
        f"            num_warps={kcfg['num_warps']}, num_stages={kcfg['num_stages']})",
        "        if kv_splits > 1:",
        f"            K.{red.name}[(st.num_decodes, {q_heads})](",
        f"                self.part_out, self.part_max, self.part_sum, st.query_start_loc, {out}, st.decode_offset, kv_splits,",
        f"                {rconsts}, num_warps={kcfg['num_warps']})",
    ]


def prefill_lines(pre, pconst: dict[str, Any], pcfg: dict[str, Any], q: str, k_cache: str, v_cache: str, out: str,
                  q_heads: int, scale: str) -> list[str]:
    """The host lines of a step's paged prefill attention (indented under ``if st.num_prefills:``): a grid of the
    step's sizes alone (T // BLOCK_M + S programs a head; each finds its sequence on the device), so a CUDA graph
    captured at T tokens and S sequence slots replays for any mix of prefill and decode sequences that fits."""
    consts = constexpr_args(pconst, ("BLOCK_SIZE",))
    return [
        f"        K.{pre.name}[(T // {pconst['BLOCK_M']} + st.num_seqs, 1, {q_heads})](",
        f"            {q}, {k_cache}, {v_cache}, {out}, st.block_tables, st.seq_lens, st.query_start_loc, st.bt_stride, "
        f"st.num_seqs, {scale},",
        f"            {consts}, BLOCK_SIZE=st.block_size,",
        f"            num_warps={pcfg['num_warps']}, num_stages={pcfg['num_stages']})",
    ]


def build_cache_write(ctx: GenContext, node):
    k_t, v_t = ctx.types[node.inputs[1]], ctx.types[node.inputs[2]]
    row = int(k_t.shape[1]) * int(k_t.shape[2])
    if int(v_t.shape[1]) * int(v_t.shape[2]) != row:
        raise Unsupported("reshape_and_cache wants K and V rows of one size")
    block = pow2(row)
    warps = ctx.row_warps("reshape_and_cache", block, k_t.dtype)
    kc, vc = ctx.cache_dtype(k_t.dtype), ctx.cache_dtype(v_t.dtype)
    params = [Param("k_ptr", ptr(k_t.dtype)), Param("v_ptr", ptr(v_t.dtype)), Param("k_cache_ptr", ptr(kc)),
              Param("v_cache_ptr", ptr(vc)), Param("slot_mapping_ptr", "*i64"), Param("n_tokens", "i32"),
              Param("ROW", "constexpr"), Param("BLOCK", "constexpr")]
    spec = make_kernel("triton/reshape_and_cache.py.j2", "reshape_and_cache", short_dtype(k_t.dtype), params,
                       {"ROW": row, "BLOCK": block}, warps, doc="Write new K/V into the paged cache.", kv_fp8=is_fp8(kc))
    return spec, row, block, warps


def build_attention(ctx: GenContext, group: KernelGroup) -> GroupCode:
    (node,) = group.nodes
    q, k, v = node.inputs[:3]
    out = node.outputs[0].name
    layer = int(node.attrs.get("layer", 0))
    written = bool(group.record.get("kv_written_by"))  # the rope kernel stores K/V (passes/fuse_kv.py)
    cache, row, block, cw = build_cache_write(ctx, node)
    pre, pconst, c, pcfg = build_prefill(ctx, node, paged=True)
    dense, dconst, _, _ = build_prefill(ctx, node, paged=False)
    dec, red, kconst, _, kcfg = build_decode(ctx, node)

    s = repr(c["scale"])
    lines = [
        f"# {c['HQ']} query heads over {c['HKV']} KV heads of {c['D']}, {'causal' if c['causal'] else 'bidirectional'}",
        "if st.paged:",
        f"    k_cache, v_cache = {ctx.kv_cache_expr(layer)}",
        *(["    # K/V are in the cache already: the rope kernel wrote them"] if written else [
            "    if st.slot_mapping is not None:",
            f"        K.{cache.name}[(T,)]({k}, {v}, k_cache, v_cache, st.slot_mapping, T, ROW={row}, BLOCK={block}, "
            f"num_warps={cw})"]),
        "    if st.num_prefills:",
        *prefill_lines(pre, pconst, pcfg, q, "k_cache", "v_cache", out, c["HQ"], s),
        "    if st.num_decodes:",
        *decode_lines(ctx, dec, red, kconst, kcfg, q, "k_cache", "v_cache", out, c["HKV"], c["HQ"], s),
        "else:",
        f"    K.{dense.name}[(triton.cdiv(st.max_query_len, {dconst['BLOCK_M']}), st.num_seqs, {c['HQ']})](",
        f"        {q}, {k}, {v}, {out}, st.query_start_loc, {s}, {constexpr_args(dconst)},",
        f"        num_warps={pcfg['num_warps']}, num_stages={pcfg['num_stages']})",
    ]
    code = GroupCode(([] if written else [cache]) + [pre, dense, dec, red], lines, [out])
    code.kernels[-1].extra["scratch"] = (c["HQ"], kconst["NUM_SPLITS"], c["BLOCK_D"])
    return code
