"""GEMM groups: a Triton matmul with a fused epilogue, or the vendor GEMM through torch.

Which one runs is decided per step from the token count (the rule lives in
codegen/gemm_rule.py, measured on the GPU); the epilogue is fused into the Triton GEMM and
becomes a pointwise kernel after the vendor GEMM.
"""

from __future__ import annotations

from typing import Any

from portlayer.codegen.expr import IndexContext, Unsupported, load_line, lower_chain
from portlayer.codegen.kernels.context import (
    GenContext,
    GroupCode,
    dot_args,
    host_numel,
    make_kernel,
    round_dtype,
)
from portlayer.codegen.kernels.pointwise import build_pointwise
from portlayer.codegen.spec import Param, ptr, short_dtype


def build_gemm_kernel(ctx: GenContext, group: dict[str, Any]):
    """The Triton GEMM spec for a group (linear + optional epilogue nodes)."""
    nodes = [ctx.nodes[n] for n in group["nodes"]]
    lin, epi = nodes[0], nodes[1:]
    if lin.op != "linear":
        raise Unsupported(f"gemm group {group['name']} starts with {lin.op!r}, not linear")
    x, w = lin.inputs[0], lin.inputs[1]
    bias = lin.inputs[2] if len(lin.inputs) > 2 else None
    x_t, w_t = ctx.types[x], ctx.types[w]
    if x_t.rank != 2:
        raise Unsupported("the Triton GEMM takes a [tokens, K] activation")
    n_out, k_in = int(w_t.shape[0]), int(w_t.shape[1])
    out_name = (epi[-1] if epi else lin).outputs[0].name
    out_t = ctx.types[out_name]
    body = None
    if epi:
        ictx = IndexContext(full="offs", mask="cmask", row="rm[:, None]", col="rn[None, :]")
        body = lower_chain(epi, ctx.types, out_t.shape, ictx, bound={lin.outputs[0].name: "y"}, prefix="e")
    cfg = ctx.cfg("gemm")
    params = [Param("a_ptr", ptr(x_t.dtype)), Param("w_ptr", ptr(w_t.dtype))]
    if bias:
        params.append(Param("bias_ptr", ptr(ctx.types[bias].dtype)))
    epi_ops = body.operands if body else []
    params += [Param(f"{op.var}_ptr", ptr(op.dtype)) for op in epi_ops]
    params += [Param("c_ptr", ptr(out_t.dtype)), Param("M", "i32")]
    const = {"N": n_out, "K": k_in, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
             "GROUP_M": 8}
    params += [Param(c, "constexpr") for c in const]
    variant = ("epi_" + "_".join(n.op for n in epi[:3]) + "_" if epi else "") + short_dtype(x_t.dtype)
    spec = make_kernel(
        "triton/gemm.py.j2", "gemm", variant, params, const, cfg["num_warps"], cfg["num_stages"],
        doc="Matrix multiply with a fused epilogue." if epi else "Matrix multiply.",
        node_names=[n.name for n in nodes], has_bias=bool(bias), dot_args=dot_args(x_t.dtype),
        epilogue_ptrs=[f"{op.var}_ptr" for op in epi_ops],
        epilogue_loads=[load_line(op, f"{op.var}_ptr", "cmask") for op in epi_ops],
        epilogue_lines=body.lines if body else [], epilogue_result=body.results[out_name] if body else "y",
        round_dtype=round_dtype(out_t.dtype),
    )
    args = [x, w] + ([bias] if bias else []) + [op.value for op in epi_ops] + [out_name]
    return spec, args, const, cfg


def build_gemm(ctx: GenContext, group: dict[str, Any]) -> GroupCode:
    nodes = [ctx.nodes[n] for n in group["nodes"]]
    lin, epi = nodes[0], nodes[1:]
    x, w = lin.inputs[0], lin.inputs[1]
    bias = lin.inputs[2] if len(lin.inputs) > 2 else None
    lin_out = lin.outputs[0].name
    code = GroupCode()
    # Vendor path: cuBLAS / hipBLASLt through torch, then the epilogue as one pointwise kernel.
    vendor = [f"torch.addmm({bias}, {x}, W_T({w}), out={lin_out})" if bias
              else f"torch.mm({x}, W_T({w}), out={lin_out})"]
    if epi:
        pw = build_pointwise(ctx, group, [n.name for n in epi], [n for n in group["outputs"] if n != lin_out])
        code.kernels += pw.kernels
        vendor += pw.lines
    code.buffers = [lin_out] + [n.outputs[0].name for n in epi if n.outputs[0].name in group["outputs"]]
    limit = ctx.triton_gemm_max_tokens
    if limit <= 0:
        code.lines = vendor
        return code
    spec, args, const, cfg = build_gemm_kernel(ctx, group)
    code.kernels.append(spec)
    consts = ", ".join(f"{c}={v}" for c, v in const.items() if c != "BLOCK_M")
    m = host_numel(ctx.types[x].shape[:-1])  # T, or S for per-sequence rows (e.g. sampled logits)
    grid = f"(triton.cdiv({m}, bm) * triton.cdiv({const['N']}, {const['BLOCK_N']}),)"
    triton_line = (f"K.{spec.name}[{grid}]({', '.join(args)}, {m}, BLOCK_M=bm, {consts}, "
                   f"num_warps={cfg['num_warps']}, num_stages={cfg['num_stages']})")
    pre = f"bm = gemm_block_m({m}, {const['BLOCK_M']})"
    if limit >= 1 << 30:
        code.lines = [pre, triton_line]
    else:
        code.lines = [f"if {m} <= {limit}:  # gemm_rule: the Triton GEMM wins at few rows",
                      f"    {pre}", f"    {triton_line}", "else:"] + [f"    {v}" for v in vendor]
    return code
