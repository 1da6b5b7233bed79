"""GEMM groups: a Triton matmul (plain or weight-only quantized) with a fused pointwise epilogue,
or the vendor GEMM through torch followed by the epilogue as one pointwise kernel.

For an unquantized ``linear`` the choice is made per step from the token count (the rule is
codegen/gemm_rule.py's, from the descriptor); the fused epilogue then needs the linear's own
output in memory on the vendor path, which the lowering declares as scratch so the memory plan
places it. ``linear_wq`` always runs the Triton kernel: the weight is dequantized tile by tile in
the K loop, so no integer tensor ever reaches torch.mm and no float copy of the weight exists.
"""

from __future__ import annotations

from portlayer.codegen.expr import IndexContext, Unsupported, load_line, lower_chain
from portlayer.codegen.kernels.context import GenContext, dot_args, host_numel, make_kernel, round_dtype
from portlayer.codegen.kernels.pointwise import build_pointwise
from portlayer.codegen.lowering import GroupCode, GroupQuery, KernelGroup
from portlayer.codegen.spec import FLOAT_DTYPES, Param, ptr, short_dtype
from portlayer.flatten.ir import Node, normalize_dim
from portlayer.flatten.ops import get_op

GEMM_IDX = IndexContext(full="offs", mask="cmask", row="rm[:, None]", col="rn[None, :]")


def accepts_gemm(query: GroupQuery, nodes: list[Node]) -> tuple[bool, str]:
    """A linear / linear_wq first, on a [rows, K] activation, then pointwise epilogue nodes over its
    output whose extra operands are parameters or other GEMMs' outputs; only the last value leaves."""
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
    shape = [normalize_dim(d) for d in lin.outputs[0].type.shape]
    produced = {v.name for n in nodes for v in n.outputs}
    for n in epi:
        if get_op(n.op).kind != "pointwise":
            return False, f"{n.op} cannot be a GEMM epilogue (pointwise only)"
        if [normalize_dim(d) for d in n.outputs[0].type.shape] != shape:
            return False, f"epilogue {n.name} does not iterate over the GEMM output {shape}"
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


def gemm_scratch(group: KernelGroup) -> list[str]:
    """The vendor path writes the linear's output before the epilogue kernel reads it."""
    lin = group.nodes[0]
    if lin.op == "linear" and len(group.nodes) > 1:
        return [lin.outputs[0].name]
    return []


def _block_k(k_group: int, want: int, minimum: int) -> int:
    """The largest power of two <= want that divides the quantization group (tiles stay in a group)."""
    b = 1
    while b * 2 <= want and k_group % (b * 2) == 0:
        b *= 2
    if b < minimum:
        raise Unsupported(f"group size {k_group} has no power-of-two tile >= {minimum} dividing it")
    return b


def build_gemm_kernel(ctx: GenContext, group: KernelGroup):
    """The Triton GEMM spec for a group (linear or linear_wq + optional epilogue nodes)."""
    nodes = group.nodes
    lin, epi = nodes[0], nodes[1:]
    quant = None
    if lin.op == "linear_wq":
        x, qw, sc = lin.inputs[:3]
        bias = lin.inputs[3] if len(lin.inputs) > 3 else None
        off = lin.inputs[4] if len(lin.inputs) > 4 else None
        bits, gsize = int(lin.attrs["bits"]), int(lin.attrs["group_size"])
        quant = {"bits": bits, "offsets": off is not None}
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
    cfg = ctx.cfg("gemm")
    const = {"N": n_out, "K": k_in, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
             "GROUP_M": 8}
    params = [Param("a_ptr", ptr(x_t.dtype))]
    args = [x]
    if quant:
        const["BLOCK_K"] = _block_k(gsize, cfg["BLOCK_K"], 32 if bits == 4 else 16)
        const["G"] = gsize
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
    params += [Param(c, "constexpr") for c in const]
    variant = (f"w{quant['bits']}{'a' if quant['offsets'] else ''}_" if quant else "")
    variant += ("epi_" + "_".join(n.op for n in epi[:3]) + "_" if epi else "") + short_dtype(x_t.dtype)
    spec = make_kernel(
        "triton/gemm.py.j2", "gemm", variant, params, const, cfg["num_warps"], cfg["num_stages"],
        doc=("Weight-only quantized matrix multiply" if quant else "Matrix multiply")
        + (" with a fused epilogue." if epi else "."),
        has_bias=bool(bias), dot_args=dot_args(x_t.dtype), quant=quant,
        epilogue_ptrs=[f"{op.var}_ptr" for op in epi_ops],
        epilogue_loads=[load_line(op, f"{op.var}_ptr", "cmask") for op in epi_ops],
        epilogue_lines=body.lines if body else [], epilogue_result=body.results[out_name] if body else "y",
        round_dtype=round_dtype(out_t.dtype),
    )
    args += [op.value for op in epi_ops] + [out_name]
    return spec, args, const, cfg


def _triton_lines(ctx: GenContext, group: KernelGroup, spec, args, const, cfg) -> list[str]:
    consts = ", ".join(f"{c}={v}" for c, v in const.items() if c != "BLOCK_M")
    m = host_numel(ctx.types[group.nodes[0].inputs[0]].shape[:-1])  # T, or S for per-sequence rows
    grid = f"(triton.cdiv({m}, bm) * triton.cdiv({const['N']}, {const['BLOCK_N']}),)"
    return [f"bm = gemm_block_m({m}, {const['BLOCK_M']})",
            f"K.{spec.name}[{grid}]({', '.join(args)}, {m}, BLOCK_M=bm, {consts}, "
            f"num_warps={cfg['num_warps']}, num_stages={cfg['num_stages']})"]


def build_gemm(ctx: GenContext, group: KernelGroup) -> GroupCode:
    nodes = group.nodes
    lin, epi = nodes[0], nodes[1:]
    out_name = (epi[-1] if epi else lin).outputs[0].name
    code = GroupCode(buffers=[out_name])
    if lin.op == "linear_wq":
        spec, args, const, cfg = build_gemm_kernel(ctx, group)
        code.kernels.append(spec)
        code.lines = _triton_lines(ctx, group, spec, args, const, cfg)
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
        code.lines = vendor
        return code
    spec, args, const, cfg = build_gemm_kernel(ctx, group)
    code.kernels.append(spec)
    triton_lines = _triton_lines(ctx, group, spec, args, const, cfg)
    if limit >= 1 << 30:
        code.lines = triton_lines
    else:
        m = host_numel(ctx.types[x].shape[:-1])
        code.lines = ([f"if {m} <= {limit}:  # gemm_rule: the Triton GEMM wins at few rows"]
                      + [f"    {v}" for v in triton_lines] + ["else:"] + [f"    {v}" for v in vendor])
    return code
