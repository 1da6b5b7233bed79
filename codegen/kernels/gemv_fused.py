"""The few-rows GEMMs' fused forms at decode (gemm_rule: rows <= tuning.gemv_max_tokens, and their
tensor-core tier up to tuning.gemv_dot_max_tokens: the same launches with tl.dot as the product).

At a handful of rows every few-rows program reads the whole activation row anyway (K = hidden),
so the residual add + RMSNorm that makes it can run in each program's prologue
(templates/triton/_norm_prologue.j2): the norm's launch and its output's round trip go away.
Sibling linears of one activation share a launch two ways: split among the programs (Q|K|V, each
output stored) or, when an epilogue combines them (silu(gate) * up), every program computing the
same columns of each weight so the products meet in registers (gemv_joint.py.j2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from portlayer.codegen.expr import load_line, lower_chain
from portlayer.codegen.kernels.context import GenContext, dot_args, host_numel, make_kernel, round_dtype
from portlayer.codegen.kernels.gemm_quant import bias_of
from portlayer.codegen.kernels.gemv_tiles import (
    dot_dtype,
    few_rows_choices,
    gemv_blocks_call,
    gemv_tiles,
    pdl_trigger,
    sub_group_tiles,
    whole_k_tiles,
)
from portlayer.codegen.spec import KernelSpec, Param, ptr, short_dtype
from portlayer.flatten.ir import Node


@dataclass
class NormPrologue:
    """The kernel arguments and template flags of a [add,] rms_norm prologue."""

    params: list[Param]
    args: list[str]
    template: dict[str, Any]
    eps: float
    variant: str
    written: list[str] = field(default_factory=list)  # the residual sum, when it leaves the group


def norm_prologue(ctx: GenContext, prologue: list[Node], outputs: list[str]) -> NormPrologue:
    """``prologue`` is [rms_norm] or [add, rms_norm] (gemm_group checked it); ``outputs`` the group's."""
    norm = prologue[-1]
    add = prologue[0] if len(prologue) == 2 else None
    x = add.inputs[0] if add else norm.inputs[0]
    x_t = ctx.types[norm.inputs[0]]
    in_dtype = norm.attrs.get("dtype") or x_t.dtype
    store_sum = add is not None and add.outputs[0].name in outputs
    has_w = len(norm.inputs) > 1 and norm.inputs[1] is not None
    params, args = [Param("a_ptr", ptr(ctx.types[x].dtype))], [x]
    if add is not None:
        params.append(Param("res_ptr", ptr(ctx.types[add.inputs[1]].dtype)))
        args.append(add.inputs[1])
    if store_sum:
        params.append(Param("sum_ptr", ptr(x_t.dtype)))
        args.append(add.outputs[0].name)
    if has_w:
        params.append(Param("nw_ptr", ptr(ctx.types[norm.inputs[1]].dtype)))
        args.append(norm.inputs[1])
    template = {"residual": add is not None, "store_sum": store_sum, "has_weight": has_w,
                "round_in": round_dtype(in_dtype), "round_out": round_dtype(norm.outputs[0].type.dtype),
                "weight_offset": norm.attrs.get("weight_offset", 0.0) or 0.0}
    return NormPrologue(params, args, template, float(norm.attrs.get("eps", 0.0) or 0.0),
                        ("add_" if add else "") + ("" if store_sum or not add else "nosum_") + "rms_",
                        [add.outputs[0].name] if store_sum else [])


@dataclass
class Weights:
    """The weights of a shared few-rows launch: their kernel parameters and arguments, the tiles, and the
    quantized layout (None: float weights; gemm.accepts_gemm made sure all share one layout)."""

    params: list[Param]
    args: list[str]
    bn: int
    bk: int
    quant: dict[str, Any] | None
    least: int = 32
    dot: bool = False  # the tensor-core tier's tiles (16 columns a program; gemv_blocks(..., tensor_cores=True))
    cfg: dict[str, int] = field(default_factory=dict)  # the launch config: launch.gemv, or launch.gemv_wq (quantized)
    tile_const: dict[str, int] = field(default_factory=dict)  # the quantized CUDA-core tier's SUB and UNROLL

    @property
    def const(self) -> dict[str, int]:
        return {"G": self.quant["G"], **self.tile_const} if self.quant else {}

    @property
    def family(self) -> str:
        """The kernel family, i.e. the launch.<family> config it reads (the tuner times it under that name)."""
        return "gemv_wq" if self.tile_const else "gemv"

    @property
    def tag(self) -> str:
        return f"w{self.quant['bits']}{'a' if self.quant['offsets'] else ''}_" if self.quant else ""

    def blocks_call(self, m: str) -> str:
        return gemv_blocks_call(m, self.bk, self.least, self.dot)

    def template(self, ctx: GenContext, x_dtype: str) -> dict[str, Any]:
        """The template's tier flags: ``dot`` (the tl dtype of the tensor-core product, or None) and its args."""
        if not self.dot:
            return {"dot": None, "dot_args": ""}
        dt = dot_dtype(x_dtype, None if self.quant else ctx.types[self.args[0]].dtype)
        return {"dot": dt, "dot_args": dot_args("float32" if dt == "tl.float32" else x_dtype)}


def _weights(ctx: GenContext, linears: list[Node], n: int, k: int, parts: int = 1, dot: bool = False,
             prologue: bool = False) -> Weights:
    """``n``: the columns the programs split (their sum for siblings, one weight's for a joint launch);
    ``parts``: weights each program reads side by side (its W tile budget is shared among them);
    ``dot``: the tensor-core tier's tiles; ``prologue``: a norm prologue is fused (gemv_tiles: the two forms)."""
    cfg = ctx.cfg("gemv")
    if linears[0].op != "linear_wq":
        bn, bk = gemv_tiles({**cfg, "TILE": max(32, cfg["TILE"] // parts)}, n, k, dot=dot)
        return Weights([Param(f"w{i}_ptr", ptr(ctx.types[x.inputs[1]].dtype)) for i, x in enumerate(linears)],
                       [x.inputs[1] for x in linears], bn, bk, None, dot=dot, cfg=cfg)
    lin = linears[0]
    bits, group = int(lin.attrs["bits"]), int(lin.attrs["group_size"])
    offsets = len(lin.inputs) > 4 and lin.inputs[4] is not None
    tile_const: dict[str, int] = {}
    in_group = False
    if dot:  # each element of the tile is dequantized with its own group's scale: any K tile
        bn, bk = gemv_tiles({**cfg, "TILE": max(32, cfg["TILE"] // parts)}, n, k, dot=True)
        least = 32
    elif prologue:  # whole-K tiles: each program recomputes the row's norm
        bn, bk, in_group, least = whole_k_tiles(cfg, n, k, group, parts)
    else:  # sub-group tiles, their launch config the Plan's launch.gemv_wq
        cfg = ctx.cfg("gemv_wq")
        tiles = sub_group_tiles(cfg, k, group, parts)
        bn, bk, least, tile_const = tiles.bn, tiles.bk, tiles.least, tiles.const
    params: list[Param] = []
    args: list[str] = []
    for i, x in enumerate(linears):
        names = [x.inputs[1], x.inputs[2]] + ([x.inputs[4]] if offsets else [])
        params += [Param(f"{c}{i}_ptr", ptr(ctx.types[v].dtype)) for c, v in zip("qso", names)]
        args += names
    quant = {"bits": bits, "offsets": offsets, "G": group, "dot": dot, "in_group": in_group, "sub": bool(tile_const),
             "pdl_trigger": pdl_trigger(cfg) if tile_const else 1}
    return Weights(params, args, bn, bk, quant, least, dot, cfg, tile_const)


def sibling_gemv(ctx: GenContext, linears: list[Node], pro: NormPrologue | None, dot: bool = False
                 ) -> tuple[KernelSpec, list[str]]:
    """Sibling linears of one activation in one few-rows launch, the programs split among the weights
    (``dot``: the tensor-core tier)."""
    x_t = ctx.types[linears[0].inputs[0]]
    ns = [int(ctx.types[n.inputs[1]].shape[0]) for n in linears]
    k_in = int(x_t.shape[-1])
    ws = _weights(ctx, linears, sum(ns), k_in, dot=dot, prologue=pro is not None)
    cfg = ws.cfg
    bn, bk = ws.bn, ws.bk
    parts = len(linears)
    biases = [bias_of(n) for n in linears]
    out_t = linears[0].outputs[0].type
    head = pro.params if pro else [Param("a_ptr", ptr(x_t.dtype))]
    params = (head + ws.params
              + [Param(f"b{i}_ptr", ptr(ctx.types[b].dtype)) for i, b in enumerate(biases) if b]
              + [Param(f"c{i}_ptr", ptr(out_t.dtype)) for i in range(parts)] + [Param(f"N{i}", "i32") for i in range(parts)]
              + [Param("M", "i32")] + ([Param("eps", "fp32")] if pro else [])
              + [Param(c, "constexpr") for c in ("K", "BLOCK_M", "BLOCK_N", "BLOCK_K", *ws.const)])
    const = {"K": k_in, "BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": bk, **ws.const}
    starts = ["0"] + [" + ".join(f"tl.cdiv(N{j}, BLOCK_N)" for j in range(i + 1)) for i in range(parts)]
    variant = ("dot_" if dot else "") + (f"x{parts}_" + ws.tag + ("bias_" if any(biases) else "") + (pro.variant if pro else "")
               + short_dtype(x_t.dtype))
    spec = make_kernel("triton/gemv_siblings.py.j2", ws.family, variant, params, const, cfg["num_warps"], cfg["num_stages"],
                       parts=parts, biases=[bool(b) for b in biases], starts=starts,
                       prologue=pro.template if pro else None, quant=ws.quant, **ws.template(ctx, x_t.dtype),
                       doc=("Weight-only quantized: " if ws.quant else "")
                       + f"{parts} matrix multiplies of one activation for few rows, in one launch.")
    m = host_numel(x_t.shape[:-1])
    spec.runtime_choices = few_rows_choices(ctx, bk, ws.least, dot)
    grid = " + ".join(f"triton.cdiv({n}, {bn})" for n in ns)
    args = [*(pro.args if pro else [linears[0].inputs[0]]), *ws.args, *(b for b in biases if b),
            *(n.outputs[0].name for n in linears), *(str(n) for n in ns)]
    tail = f", {pro.eps!r}" if pro else ""
    consts = "".join(f", {c}={v}" for c, v in ws.const.items())
    return spec, [ws.blocks_call(m),
                  f"K.{spec.name}[({grid},)]({', '.join(args)}, {m}{tail}, BLOCK_M=bm, BLOCK_K=bk, K={k_in}, "
                  f"BLOCK_N={bn}{consts}, num_warps={cfg['num_warps']}, num_stages={cfg['num_stages']})"]


def joint_gemv(ctx: GenContext, linears: list[Node], epilogue: list[Node], pro: NormPrologue | None,
               dot: bool = False) -> tuple[KernelSpec, list[str], str]:
    """Linears of one activation and equal N, every program the same columns of each, and the
    epilogue that combines them (``dot``: the tensor-core tier); returns (spec, launch lines, the value it writes)."""
    from portlayer.codegen.kernels.gemm import GEMM_IDX

    x = linears[0].inputs[0]
    x_t = ctx.types[x]
    n_out = int(ctx.types[linears[0].inputs[1]].shape[0])
    k_in = int(x_t.shape[-1])
    parts = len(linears)
    ws = _weights(ctx, linears, n_out, k_in, parts, dot=dot, prologue=pro is not None)
    cfg = ws.cfg
    bn, bk = ws.bn, ws.bk
    out_name = epilogue[-1].outputs[0].name
    out_t = ctx.types[out_name]
    body = lower_chain(epilogue, ctx.types, out_t.shape, GEMM_IDX,
                       bound={n.outputs[0].name: f"y{i}" for i, n in enumerate(linears)}, prefix="e")
    biases = [bias_of(n) for n in linears]
    head = pro.params if pro else [Param("a_ptr", ptr(x_t.dtype))]
    params = (head + ws.params
              + [Param(f"b{i}_ptr", ptr(ctx.types[b].dtype)) for i, b in enumerate(biases) if b]
              + [Param(f"{op.var}_ptr", ptr(op.dtype)) for op in body.operands]
              + [Param("c_ptr", ptr(out_t.dtype)), Param("M", "i32")] + ([Param("eps", "fp32")] if pro else [])
              + [Param(c, "constexpr") for c in ("N", "K", "BLOCK_M", "BLOCK_N", "BLOCK_K", *ws.const)])
    const = {"N": n_out, "K": k_in, "BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": bk, **ws.const}
    variant = ("dot_" if dot else "") + (f"j{parts}_" + ws.tag + ("bias_" if any(biases) else "") + (pro.variant if pro else "")
               + "epi_" + "_".join(n.op for n in epilogue[:3]) + "_" + short_dtype(x_t.dtype))
    spec = make_kernel("triton/gemv_joint.py.j2", ws.family, variant, params, const, cfg["num_warps"], cfg["num_stages"],
                       parts=parts, biases=[bool(b) for b in biases], prologue=pro.template if pro else None,
                       quant=ws.quant, rounds=[round_dtype(n.outputs[0].type.dtype) for n in linears],
                       **ws.template(ctx, x_t.dtype),
                       epilogue_ptrs=[f"{op.var}_ptr" for op in body.operands],
                       epilogue_loads=[load_line(op, f"{op.var}_ptr", "cmask") for op in body.operands],
                       epilogue_lines=body.lines, epilogue_result=body.results[out_name],
                       doc=f"{parts} matrix multiplies of one activation and their fused epilogue for few rows, in one launch.")
    m = host_numel(x_t.shape[:-1])
    spec.runtime_choices = few_rows_choices(ctx, bk, ws.least, dot)
    args = [*(pro.args if pro else [x]), *ws.args, *(b for b in biases if b),
            *(op.value for op in body.operands), out_name]
    tail = f", {pro.eps!r}" if pro else ""
    consts = "".join(f", {c}={v}" for c, v in ws.const.items())
    return spec, [ws.blocks_call(m),
                  f"K.{spec.name}[(triton.cdiv({n_out}, {bn}),)]({', '.join(args)}, {m}{tail}, BLOCK_M=bm, BLOCK_K=bk, "
                  f"N={n_out}, K={k_in}, BLOCK_N={bn}{consts}, num_warps={cfg['num_warps']}, num_stages={cfg['num_stages']})"], out_name
