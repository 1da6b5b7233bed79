"""Row reductions with prologue and epilogue: rms_norm, layer_norm, softmax, add + rms_norm."""

from __future__ import annotations

from collections.abc import Mapping

from portlayer.codegen.expr import IndexContext, Unsupported, load_line, lower_chain
from portlayer.codegen.kernels.context import GenContext, host_numel, make_kernel, round_dtype
from portlayer.codegen.lowering import GroupCode, GroupQuery, KernelGroup
from portlayer.codegen.spec import Param, pow2, ptr, short_dtype
from portlayer.flatten.ir import Node, TensorType, normalize_dim

NORMS = ("rms_norm", "layer_norm", "softmax")


def _split(nodes: list[Node], types: Mapping[str, TensorType]) -> tuple[Node, list[Node], list[Node]]:
    """(the row norm, its prologue, its epilogue); raises Unsupported for shapes the template lacks."""
    idx = next((i for i, n in enumerate(nodes) if n.op in NORMS), None)
    if idx is None or idx > 1 or sum(n.op in NORMS for n in nodes) != 1:
        raise Unsupported("the row kernel takes one rms_norm/layer_norm/softmax, at most one node before it")
    norm, pro, epi = nodes[idx], nodes[:idx], nodes[idx + 1 :]
    if pro and (pro[0].op != "add" or pro[0].outputs[0].name != norm.inputs[0] or len(pro[0].inputs) != 2
                or None in pro[0].inputs or types[pro[0].inputs[0]].shape != types[pro[0].inputs[1]].shape):
        raise Unsupported("only a residual add of two equal-shape tensors is supported as a reduction prologue")
    x_t = types[norm.inputs[0]]
    if norm.op == "softmax" and norm.attrs.get("dim", -1) not in (-1, x_t.rank - 1):
        raise Unsupported("softmax over a non-last axis")
    if not x_t.shape or not isinstance(x_t.shape[-1], int):
        raise Unsupported("the reduced axis must be static")
    shape = [normalize_dim(d) for d in norm.outputs[0].type.shape]
    for n in epi:
        if [normalize_dim(d) for d in n.outputs[0].type.shape] != shape:
            raise Unsupported(f"{n.name} does not iterate over the normalised rows {shape}")
    if epi:
        ictx = IndexContext(full="row * N + cols", mask="mask", col="cols")
        lower_chain(epi, types, norm.outputs[0].type.shape, ictx, bound={norm.outputs[0].name: "y"}, prefix="e")
    return norm, pro, epi


split_row_norm = _split  # the GEMM's norm prologue (gemm_group.py) is this kernel's shape too


def accepts_reduction(query: GroupQuery, nodes: list[Node]) -> tuple[bool, str]:
    """One row norm with a residual-add prologue and a pointwise epilogue; only the residual sum
    and the last node's value may leave the kernel (those are the two stores it makes)."""
    try:
        norm, pro, epi = _split(nodes, query.types)
    except Unsupported as e:
        return False, str(e)
    members = {n.name for n in nodes}
    for n in [norm, *epi][:-1]:
        if query.used_outside(n.outputs[0].name, members):
            return False, f"{n.outputs[0].name} is read outside the kernel, which stores only its last value"
    return True, ""


def build_reduction(ctx: GenContext, group: KernelGroup) -> GroupCode:
    nodes = group.nodes
    norm, pro, epi = _split(nodes, ctx.types)
    residual = bool(pro)
    x_name = pro[0].inputs[0] if residual else norm.inputs[0]
    x_t = ctx.types[norm.inputs[0]]
    out_name = (epi[-1] if epi else norm).outputs[0].name
    out_t = ctx.types[out_name]
    n_cols = x_t.shape[-1]
    block_n = pow2(n_cols)
    has_w = len(norm.inputs) > 1 and norm.inputs[1] is not None
    has_b = len(norm.inputs) > 2 and norm.inputs[2] is not None
    in_dtype = norm.attrs.get("dtype") or x_t.dtype
    epi_loads: list[str] = []
    epi_lines: list[str] = []
    epi_ptrs: list[str] = []
    epi_result = "y"
    epi_values: list[str] = []
    if epi:
        ictx = IndexContext(full="row * N + cols", mask="mask", col="cols")
        body = lower_chain(epi, ctx.types, out_t.shape, ictx, bound={norm.outputs[0].name: "y"}, prefix="e")
        epi_ptrs = [f"{op.var}_ptr" for op in body.operands]
        epi_loads = [load_line(op, f"{op.var}_ptr", "mask") for op in body.operands]
        epi_lines, epi_result = body.lines, body.results[out_name]
        epi_values = [op.value for op in body.operands]
    params = [Param("x_ptr", ptr(ctx.types[x_name].dtype))]
    args = [x_name]
    store_sum = residual and pro[0].outputs[0].name in group.outputs
    if residual:
        params.append(Param("res_ptr", ptr(ctx.types[pro[0].inputs[1]].dtype)))
        args.append(pro[0].inputs[1])
    if store_sum:
        params.append(Param("sum_ptr", ptr(x_t.dtype)))
        args.append(pro[0].outputs[0].name)
    if has_w:
        params.append(Param("w_ptr", ptr(ctx.types[norm.inputs[1]].dtype)))
        args.append(norm.inputs[1])
    if has_b:
        params.append(Param("b_ptr", ptr(ctx.types[norm.inputs[2]].dtype)))
        args.append(norm.inputs[2])
    params += [Param(p, ptr(ctx.types[v].dtype)) for p, v in zip(epi_ptrs, epi_values)]
    args += epi_values + [out_name]
    params += [Param("out_ptr", ptr(out_t.dtype)), Param("n_rows", "i32"), Param("eps", "fp32"),
               Param("N", "constexpr"), Param("BLOCK_N", "constexpr")]
    warps = ctx.row_warps("reduction", block_n, x_t.dtype)
    variant = ("add_" if residual else "") + ("" if store_sum or not residual else "nosum_") + norm.op + ("_epi" if epi else "") + "_" + short_dtype(x_t.dtype)
    spec = make_kernel(
        "triton/reduction.py.j2", "reduction", variant, params, {"N": n_cols, "BLOCK_N": block_n}, warps,
        doc=f"Row {'residual add + ' if residual else ''}{norm.op}{' with a fused epilogue' if epi else ''}.",
        kind=norm.op, residual=residual, store_sum=store_sum, has_weight=has_w, has_bias=has_b,
        round_dtype=round_dtype(in_dtype) if norm.op == "rms_norm" or residual else None,
        weight_offset=norm.attrs.get("weight_offset", 0.0) or 0.0, dtype=x_t.dtype, N=n_cols,
        epilogue_ptrs=epi_ptrs, epilogue_loads=epi_loads, epilogue_lines=epi_lines, epilogue_result=epi_result,
    )
    rows = host_numel(x_t.shape[:-1]) if x_t.rank > 1 else "1"
    eps = float(norm.attrs.get("eps", 0.0) or 0.0)
    line = (f"K.{spec.name}[({rows},)]({', '.join(args)}, {rows}, {eps!r}, N={n_cols}, BLOCK_N={block_n}, "
            f"num_warps={warps})")
    written = ([pro[0].outputs[0].name] if store_sum else []) + [out_name]
    return GroupCode([spec], [line], written)
