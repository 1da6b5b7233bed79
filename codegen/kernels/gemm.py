"""GEMM groups: a Triton matmul (plain or weight-only quantized) with a fused pointwise epilogue,
or the vendor GEMM through torch followed by the epilogue as one pointwise kernel.

For an unquantized ``linear`` the choice is made per step from the token count (the rule is
codegen/gemm_rule.py's, from the descriptor); the fused epilogue then needs the linear's own
output in memory on the vendor path, which the lowering declares as scratch so the memory plan
places it. ``linear_wq`` runs the Triton kernels (the few-rows one at decode, the tiled one above),
the weight dequantized tile by tile in the K loop, so no integer tensor ever reaches torch.mm; from
``tuning.wq_vendor_min_tokens`` rows one launch dequantizes the weight into a temporary in the
activation's dtype (freed after the group: the allocator hands the same block to the next layer) and the
vendor GEMM runs on it. Why: the tiled kernel launches ceil(N / BLOCK_N) programs at any row count up to
its row tile (8-24 programs on the H200's 132 SMs for the 0.6B shape's projections at 64 rows), each
walking all of K alone; the vendor GEMM splits that work, and the dequantize costs one read of the
integers and one write of the float weight.
"""

from __future__ import annotations

from typing import Any

from portlayer.codegen.expr import IndexContext, Unsupported, load_line, lower_chain
from portlayer.codegen.host_support import gemm_block_m_choices
from portlayer.codegen.kernels.context import GenContext, dot_args, host_numel, make_kernel, round_dtype
from portlayer.codegen.kernels.gemm_quant import dequant_vendor, layout_text, quant_layout
from portlayer.codegen.kernels.gemv_tiles import (
    dot_dtype,
    few_rows_choices,
    few_rows_tiers,
    gemv_blocks_call,
    gemv_tiles,
    pdl_trigger,
    sub_group_tiles,
    tier_why,
    whole_k_tiles,
)
from portlayer.codegen.kernels.pointwise import build_pointwise
from portlayer.codegen.lowering import GroupCode, GroupQuery, KernelGroup
from portlayer.codegen.spec import FLOAT_DTYPES, Param, ptr, short_dtype
from portlayer.flatten.ir import Node, normalize_dim
from portlayer.flatten.ops import get_op


def kind_of(n: Node) -> str:
    return get_op(n.op).kind

GEMM_IDX = IndexContext(full="offs", mask="cmask", row="rm[:, None]", col="rn[None, :]")


def siblings(nodes: list[Node]) -> bool:
    """Several linears (plain or weight-only quantized) and nothing else: the projections of one input."""
    return len(nodes) > 1 and all(n.op in ("linear", "linear_wq") for n in nodes)


def _accepts_siblings(query: GroupQuery, nodes: list[Node]) -> tuple[bool, str]:
    x = nodes[0].inputs[0]
    for n in nodes:
        if n.inputs[0] != x:
            return False, f"{n.name} reads {n.inputs[0]}, not {x}: only projections of one input share a launch"
        lay, first = quant_layout(n, query.types), quant_layout(nodes[0], query.types)
        if lay != first:
            return False, (f"{layout_text(nodes[0], first)} and {layout_text(n, lay)}: one launch reads one weight "
                           "layout (quantize the siblings alike, or they run as separate kernels)")
        if query.types[n.inputs[1]].dtype != query.types[nodes[0].inputs[1]].dtype:
            return False, "the sibling weights differ in dtype"
        if n.outputs[0].type.dtype != nodes[0].outputs[0].type.dtype:
            return False, "the sibling outputs differ in dtype"
    x_t = query.types[x]
    if x_t.rank != 2 or not isinstance(x_t.shape[1], int) or nodes[0].outputs[0].type.dtype not in FLOAT_DTYPES:
        return False, f"the sibling kernel takes a [rows, K] float activation with static K, not {x_t}"
    return True, ""


def accepts_gemm(query: GroupQuery, nodes: list[Node]) -> tuple[bool, str]:
    """A linear / linear_wq first, on a [rows, K] activation, then pointwise epilogue nodes over its
    output whose extra operands are parameters or other GEMMs' outputs; only the last value leaves.
    Or: several bias-free linears of one input side by side (``siblings``), each output leaving."""
    if len(nodes) > 1 and sum(kind_of(n) == "gemm" for n in nodes) > 1:
        if not siblings(nodes):
            return False, "a GEMM kernel holds one linear and its epilogue, or sibling linears of one input alone"
        return _accepts_siblings(query, nodes)
    lin, epi = nodes[0], nodes[1:]
    if lin.op not in ("linear", "linear_wq"):
        return False, f"the GEMM kernel starts with a linear, not {lin.op}"
    x_t = query.types[lin.inputs[0]]
    if x_t.rank != 2 or not isinstance(x_t.shape[1], int):
        return False, f"the Triton GEMM takes a [rows, K] activation with static K, not {x_t}"
    if lin.outputs[0].type.dtype not in FLOAT_DTYPES:
        return False, f"output dtype {lin.outputs[0].type.dtype} is not a float"
    if not epi:
        return True, ""
    members = {n.name for n in nodes}
    produced = {v.name for n in nodes for v in n.outputs}
    why = epilogue_shape_refusal(epi, lin.outputs[0].type.shape)
    if why:
        return False, why
    for n in epi:
        for i in n.inputs:
            if i is None or i in produced or i in query.graph.params:
                continue
            p = query.producer(i)
            if p is None or get_op(p.op).kind != "gemm":
                return False, (f"epilogue operand {i} is not a parameter or a GEMM output (a residual stream: "
                               "it fuses with the following norm)")
    for n in nodes[:-1]:
        if query.used_outside(n.outputs[0].name, members):
            return False, f"{n.outputs[0].name} is read outside the kernel, which stores only its last value"
    try:
        lower_chain(epi, query.types, lin.outputs[0].type.shape, GEMM_IDX, bound={lin.outputs[0].name: "y"}, prefix="e")
        lower_chain(epi, query.types, lin.outputs[0].type.shape, IndexContext(full="offs", mask="mask"))
    except Unsupported as e:
        return False, f"the epilogue cannot be generated: {e}"
    return True, ""


def epilogue_shape_refusal(epi: list[Node], out_shape: Any) -> str:
    """Why ``epi`` cannot run in a GEMM's epilogue over an output of ``out_shape`` ('' when it can): every
    node pointwise and iterating over that output."""
    shape = [normalize_dim(d) for d in out_shape]
    for n in epi:
        if get_op(n.op).kind != "pointwise":
            return f"{n.op} cannot be a GEMM epilogue (pointwise only)"
        if [normalize_dim(d) for d in n.outputs[0].type.shape] != shape:
            return f"epilogue {n.name} does not iterate over the GEMM output {shape}"
    return ""


def gemm_scratch(group: KernelGroup) -> list[str]:
    """The vendor path writes the linear's output before the epilogue kernel reads it (declared whether or
    not this descriptor takes the path: scratch is asked of a group, not of a target)."""
    lin = group.nodes[0]
    if lin.op in ("linear", "linear_wq") and len(group.nodes) > 1 and not siblings(group.nodes):
        return [lin.outputs[0].name]  # linear_wq: the dequantize + vendor path (tuning.wq_vendor_min_tokens)
    return []


def _block_k(k_group: int, want: int, minimum: int) -> int:
    """The largest power of two <= want that divides the quantization group (tiles stay in a group)."""
    b = 1
    while b * 2 <= want and k_group % (b * 2) == 0:
        b *= 2
    if b < minimum:
        raise Unsupported(f"group size {k_group} has no power-of-two tile >= {minimum} dividing it")
    return b


def build_gemm_kernel(ctx: GenContext, group: KernelGroup, few_rows: bool = False, prologue: Any = None,
                      dot: bool = False):
    """The Triton GEMM spec for a group (linear or linear_wq + optional epilogue nodes);
    ``few_rows``: the decode kernel (gemv.py.j2), same operands, CUDA-core dot products (``dot``: its
    tensor-core tier, tl.dot); ``prologue``: its norm prologue (gemv_fused.NormPrologue: the activation is
    computed in-kernel)."""
    nodes = group.nodes
    lin, epi = nodes[0], nodes[1:]
    quant = None
    if lin.op == "linear_wq":
        x, qw, sc = lin.inputs[:3]
        bias = lin.inputs[3] if len(lin.inputs) > 3 else None
        off = lin.inputs[4] if len(lin.inputs) > 4 else None
        bits, gsize = int(lin.attrs["bits"]), int(lin.attrs["group_size"])
        quant = {"bits": bits, "offsets": off is not None, "dot": False, "in_group": False, "sub": False,
                 "pdl_trigger": 1}
        n_out = int(ctx.types[qw].shape[0])
        k_in = int(ctx.types[x].shape[-1])
    else:
        x, w = lin.inputs[0], lin.inputs[1]
        bias = lin.inputs[2] if len(lin.inputs) > 2 else None
        n_out, k_in = (int(d) for d in ctx.types[w].shape)
    x_t = ctx.types[x]
    out_name = (epi[-1] if epi else lin).outputs[0].name
    out_t = ctx.types[out_name]
    body = None
    if epi:
        body = lower_chain(epi, ctx.types, out_t.shape, GEMM_IDX, bound={lin.outputs[0].name: "y"}, prefix="e")
    cfg = ctx.cfg("gemv" if few_rows else "gemm")
    if few_rows:
        bn, bk = gemv_tiles(cfg, n_out, k_in, dot=dot)
        qconst: dict[str, int] = {}
        if quant and dot:  # the tile is dequantized element by element: any K tile, each column its group's scale
            quant.update(least=32, dot=True)
        elif quant and prologue is not None:  # whole-K tiles: each program recomputes the row's norm
            bn, bk, quant["in_group"], quant["least"] = whole_k_tiles(cfg, n_out, k_in, gsize)
        elif quant:  # sub-group tiles, their launch config the Plan's launch.gemv_wq
            cfg = ctx.cfg("gemv_wq")
            tiles = sub_group_tiles(cfg, k_in, gsize)
            bn, bk, quant["least"], qconst, quant["sub"] = tiles.bn, tiles.bk, tiles.least, tiles.const, True
            quant["pdl_trigger"] = pdl_trigger(cfg)
        const = {"N": n_out, "K": k_in, "BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": bk}
    else:
        const = {"N": n_out, "K": k_in, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
                 "GROUP_M": 8}
    params = [Param("a_ptr", ptr(x_t.dtype))]
    args = [x]
    if prologue is not None:
        params, args = [*prologue.params, *params[1:]], [*prologue.args, *args[1:]]
    if quant:
        if not few_rows:  # the tensor-core kernel scales a whole K tile once: tiles stay in a group
            const["BLOCK_K"] = _block_k(gsize, cfg["BLOCK_K"], 32 if bits == 4 else 16)
        const["G"] = gsize
        if few_rows:
            const.update(qconst)
        params += [Param("q_ptr", ptr(ctx.types[qw].dtype)), Param("s_ptr", ptr(ctx.types[sc].dtype))]
        args += [qw, sc]
        if off is not None:
            params.append(Param("o_ptr", ptr(ctx.types[off].dtype)))
            args.append(off)
    else:
        params.append(Param("w_ptr", ptr(ctx.types[w].dtype)))
        args.append(w)
    if bias:
        params.append(Param("bias_ptr", ptr(ctx.types[bias].dtype)))
        args.append(bias)
    epi_ops = body.operands if body else []
    params += [Param(f"{op.var}_ptr", ptr(op.dtype)) for op in epi_ops]
    params += [Param("c_ptr", ptr(out_t.dtype)), Param("M", "i32")]
    params += [Param("eps", "fp32")] if prologue is not None else []
    params += [Param(c, "constexpr") for c in const]
    tier_dtype = dot_dtype(x_t.dtype, None if quant else ctx.types[w].dtype) if few_rows and dot else None
    variant = ("dot_" if tier_dtype else "") + (f"w{quant['bits']}{'a' if quant['offsets'] else ''}_" if quant else "")
    variant += prologue.variant if prologue is not None else ""
    variant += ("epi_" + "_".join(n.op for n in epi[:3]) + "_" if epi else "") + short_dtype(x_t.dtype)
    family = ("gemv_wq" if quant and quant["sub"] else "gemv") if few_rows else "gemm"  # its launch.<family>
    spec = make_kernel(
        "triton/gemv.py.j2" if few_rows else "triton/gemm.py.j2", family, variant, params,
        const, cfg["num_warps"], cfg["num_stages"],
        doc=("Weight-only quantized " if quant else "") + ("matrix multiply for few rows" if few_rows else "matrix multiply")
        + (" with a fused epilogue." if epi else "."),
        has_bias=bool(bias), dot_args=dot_args("float32" if tier_dtype == "tl.float32" else x_t.dtype), quant=quant,
        epilogue_ptrs=[f"{op.var}_ptr" for op in epi_ops],
        epilogue_loads=[load_line(op, f"{op.var}_ptr", "cmask") for op in epi_ops],
        epilogue_lines=body.lines if body else [], epilogue_result=body.results[out_name] if body else "y",
        round_dtype=round_dtype(out_t.dtype), prologue=prologue.template if prologue is not None else None,
        dot=tier_dtype,
    )
    if few_rows:
        spec.extra["gemv_dot"] = dot
    if quant and few_rows:
        spec.extra["gemv_least"] = quant["least"]  # the narrowest K tile gemv_blocks may pick (_gemv_lines)
    args += [op.value for op in epi_ops] + [out_name]
    return spec, args, const, cfg


def _triton_lines(ctx: GenContext, group: KernelGroup, spec, args, const, cfg) -> list[str]:
    consts = ", ".join(f"{c}={v}" for c, v in const.items() if c != "BLOCK_M")
    m = host_numel(ctx.types[group.nodes[0].inputs[0]].shape[:-1])  # T, or S for per-sequence rows
    grid = f"(triton.cdiv({m}, bm) * triton.cdiv({const['N']}, {const['BLOCK_N']}),)"
    spec.runtime_choices = gemm_block_m_choices(const["BLOCK_M"])
    return [f"bm = gemm_block_m({m}, {const['BLOCK_M']})",
            f"K.{spec.name}[{grid}]({', '.join(args)}, {m}, BLOCK_M=bm, {consts}, "
            f"num_warps={cfg['num_warps']}, num_stages={cfg['num_stages']})"]


def _gemv_lines(ctx: GenContext, group: KernelGroup, spec, args, const, cfg, tail: str = "") -> list[str]:
    consts = ", ".join(f"{c}={v}" for c, v in const.items() if c not in ("BLOCK_M", "BLOCK_K"))
    m = host_numel(ctx.types[group.nodes[0].inputs[0]].shape[:-1])
    grid = f"(triton.cdiv({const['N']}, {const['BLOCK_N']}),)"
    low = int(spec.extra.get("gemv_least", 32))
    dot = bool(spec.extra.get("gemv_dot"))
    spec.runtime_choices = few_rows_choices(ctx, const["BLOCK_K"], low, dot)
    return [gemv_blocks_call(m, const["BLOCK_K"], low, dot),
            f"K.{spec.name}[{grid}]({', '.join(args)}, {m}{tail}, BLOCK_M=bm, BLOCK_K=bk, {consts}, "
            f"num_warps={cfg['num_warps']}, num_stages={cfg['num_stages']})"]


def _by_rows(m: str, branches: list[tuple[int, list[str], str]], rest: list[str]) -> list[str]:
    """``if m <= limit: ... elif ...: else: rest``: the per-step choice of GEMM kernel by row count."""
    lines: list[str] = []
    for limit, body, why in branches:
        lines += [f"{'if' if not lines else 'elif'} {m} <= {limit}:  # {why}"] + [f"    {v}" for v in body]
    if not lines:
        return rest
    return lines + ["else:"] + [f"    {v}" for v in rest]


def build_gemm(ctx: GenContext, group: KernelGroup, few_rows: bool = True) -> GroupCode:
    """A GEMM group's code: the few-rows kernel at decode sizes (gemm_rule), else the Triton or
    the vendor GEMM; sibling linears share one few-rows launch and, above it, one vendor GEMM on their
    concatenated weights (gemm_merged.py; one by one where gemm_rule.merge_refusal says why not).
    ``few_rows=False``: only the kernels above the rule (a caller with its own few-rows kernel)."""
    from portlayer.codegen.kernels.gemm_merged import above_rule, can_merge, merged_siblings
    from portlayer.codegen.kernels.gemv_fused import sibling_gemv

    tiers = few_rows_tiers(ctx)
    if not siblings(group.nodes):
        return _build_one(ctx, group, few_rows=few_rows and bool(tiers))
    code = GroupCode(buffers=[n.outputs[0].name for n in group.nodes])
    rest: list[str] = []
    for n in group.nodes:
        one = KernelGroup(f"{group.name}_{n.name}", group.impl, group.family, n.name, [n], [i for i in n.inputs if i],
                          [n.outputs[0].name])
        part = _build_one(ctx, one, few_rows=False)
        code.kernels += part.kernels
        rest += part.lines
    m = host_numel(ctx.types[group.nodes[0].inputs[0]].shape[:-1])
    if can_merge(ctx, group.nodes):  # above the rules: one vendor GEMM on the concatenated weights
        rest = above_rule(ctx, m, rest, merged_siblings(ctx, group.nodes, code))
    if not tiers or not few_rows:
        code.lines = rest
        return code
    branches = []
    for limit, dot in tiers:
        spec, few = sibling_gemv(ctx, group.nodes, None, dot=dot)
        code.kernels.append(spec)
        branches.append((limit, few, tier_why(dot, "one launch, ")))
    code.lines = _by_rows(m, branches, rest)
    return code


def _build_one(ctx: GenContext, group: KernelGroup, few_rows: bool) -> GroupCode:
    nodes = group.nodes
    lin, epi = nodes[0], nodes[1:]
    out_name = (epi[-1] if epi else lin).outputs[0].name
    code = GroupCode(buffers=[out_name])
    m = host_numel(ctx.types[lin.inputs[0]].shape[:-1])
    few: list[tuple[int, list[str], str]] = []
    weight = ctx.types[lin.inputs[1]]
    small = ctx.gemv_max_weight_bytes <= 0 or weight.nbytes({}) <= ctx.gemv_max_weight_bytes
    tiers = few_rows_tiers(ctx)
    if few_rows and small:  # quantized: gemv_tiles finds a K tile for every group linear_wq's lowering takes
        for limit, dot in tiers:
            spec, args, const, cfg = build_gemm_kernel(ctx, group, few_rows=True, dot=dot)
            code.kernels.append(spec)
            few.append((limit, _gemv_lines(ctx, group, spec, args, const, cfg), tier_why(dot)))
    if lin.op == "linear_wq":
        start = ctx.wq_vendor_min_tokens
        # rows a few-rows kernel takes: this group's, or its caller's (few_rows=False: gemm_group / siblings)
        low = tiers[-1][0] if tiers and (few or (not few_rows and small)) else 0
        tiled: list[str] = []
        if start <= 0 or start - 1 > low:  # the Triton weight-only GEMM runs at some row count
            spec, args, const, cfg = build_gemm_kernel(ctx, group)
            code.kernels.append(spec)
            tiled = _triton_lines(ctx, group, spec, args, const, cfg)
        if start <= 0:
            code.lines = _by_rows(m, few, tiled)
            return code
        vendor = dequant_vendor(ctx, group, code)
        if tiled:  # between the few-rows rule and the vendor path
            few = [*few, (start - 1, tiled, "gemm_rule: below tuning.wq_vendor_min_tokens the Triton weight-only GEMM")]
        code.lines = _by_rows(m, few, vendor)
        return code
    x, w = lin.inputs[0], lin.inputs[1]
    bias = lin.inputs[2] if len(lin.inputs) > 2 else None
    lin_out = lin.outputs[0].name
    # Vendor path: cuBLAS / hipBLASLt through torch, then the epilogue as one pointwise kernel.
    vendor = [f"torch.addmm({bias}, {x}, W_T({w}), out={lin_out})" if bias
              else f"torch.mm({x}, W_T({w}), out={lin_out})"]
    if epi:
        pw = build_pointwise(ctx, group, epi, [out_name])
        code.kernels += pw.kernels
        vendor += pw.lines
        code.buffers = [lin_out, out_name]
    limit = ctx.triton_gemm_max_tokens
    if limit <= 0:
        code.lines = _by_rows(m, few, vendor)
        return code
    spec, args, const, cfg = build_gemm_kernel(ctx, group)
    code.kernels.append(spec)
    triton_lines = _triton_lines(ctx, group, spec, args, const, cfg)
    if limit >= 1 << 30:
        code.lines = _by_rows(m, few, triton_lines)
    else:
        code.lines = _by_rows(m, [*few, (limit, triton_lines, "gemm_rule: the Triton GEMM wins at few rows")], vendor)
    return code
