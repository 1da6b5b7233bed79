"""Projections of one input as ONE vendor GEMM above the few-rows rule (codegen/gemm_rule.merge_refusal).

The weights (and biases) of the group's linears are concatenated along N once, when the program loads
(``GroupCode.merged``: program.json's ``merged_weights``; each part then becomes a row-slice view of the
concatenation, so the weights are held once and the few-rows kernels still read each part alone). A step
runs ``torch.mm`` on the concatenation into a temporary ``[rows, N0 + N1 + ...]``, then one kernel:

- sibling linears whose outputs leave the group (Q|K|V): a column split into the planned buffers;
- sibling linears of equal N combined by an epilogue (gate|up, SiLU(gate)*up): the epilogue, reading each
  linear's columns of the temporary (rows of the temporary are ``N * parts`` wide).

So three GEMM launches become one and a copy (Q|K|V), two GEMMs and the epilogue one GEMM and the epilogue.
"""

from __future__ import annotations

from portlayer.codegen.expr import IndexContext, load_line, lower_chain
from portlayer.codegen.gemm_rule import merge_refusal, merged_name
from portlayer.codegen.kernels.context import GenContext, host_numel, make_kernel
from portlayer.codegen.kernels.gemm_quant import bias_of
from portlayer.codegen.lowering import GroupCode
from portlayer.codegen.spec import Param, ptr, short_dtype
from portlayer.flatten.ir import Node

TMP = "cat_tmp"  # the step's [rows, sum N] GEMM output; freed after the group (the next layer reuses the block)


def can_merge(ctx: GenContext, linears: list[Node]) -> bool:
    """The merge rule's answer, on a target whose vendor GEMM runs at some row count (a
    ``tuning.triton_gemm_max_tokens`` of 2**30 or more runs the Triton GEMMs at every row count)."""
    return ctx.triton_gemm_max_tokens < 1 << 30 and not merge_refusal(linears, ctx.types, ctx.graph.params)


def above_rule(ctx: GenContext, rows: str, one_by_one: list[str], merged: list[str]) -> list[str]:
    """Above the few-rows rule: the merged vendor GEMM, and below ``tuning.triton_gemm_max_tokens`` rows the
    linears' Triton GEMMs one by one (``one_by_one``), as without the merge."""
    from portlayer.codegen.kernels.gemm import _by_rows

    limit = ctx.triton_gemm_max_tokens
    return merged if limit <= 0 else _by_rows(rows, [(limit, one_by_one, "gemm_rule: the Triton GEMM wins at few rows")], merged)


def _gemm_lines(ctx: GenContext, linears: list[Node], code: GroupCode) -> list[str]:
    """Register the concatenated weight (and bias) and the one vendor GEMM into ``cat_tmp``."""
    x = linears[0].inputs[0]
    weights = [n.inputs[1] for n in linears]
    w = merged_name(weights)
    code.merged[w] = weights
    if bias_of(linears[0]):  # merge_refusal: all linears have one, or none
        biases = [bias_of(n) for n in linears]
        b = merged_name(biases)
        code.merged[b] = biases
        return [f"{TMP} = torch.addmm({b}, {x}, W_T({w}))  # {' | '.join(n.name for n in linears)}: one GEMM"]
    return [f"{TMP} = torch.mm({x}, W_T({w}))  # {' | '.join(n.name for n in linears)}: one GEMM"]


def merged_siblings(ctx: GenContext, linears: list[Node], code: GroupCode) -> list[str]:
    """One GEMM, then one launch copies each linear's columns into its own planned buffer."""
    ns = [int(ctx.types[n.inputs[1]].shape[0]) for n in linears]
    total = sum(ns)
    dtype = linears[0].outputs[0].type.dtype
    cfg = ctx.cfg("pointwise")
    block = min(int(cfg["BLOCK"]), 1 << max(4, (total - 1).bit_length()))
    starts = [sum(ns[:i]) for i in range(len(ns))]
    parts = [{"start": s, "end": s + n, "width": n} for s, n in zip(starts, ns)]
    params = [Param("c_ptr", ptr(dtype))] + [Param(f"out{i}_ptr", ptr(dtype)) for i in range(len(ns))]
    params += [Param("BLOCK", "constexpr")]
    spec = make_kernel("triton/split_columns.py.j2", "pointwise", f"split{len(ns)}_{short_dtype(dtype)}", params,
                       {"BLOCK": block}, cfg["num_warps"], total=total, parts=parts,
                       doc=f"Columns of one [rows, {total}] GEMM output into {len(ns)} dense buffers "
                           f"({', '.join(map(str, ns))} columns).")
    code.kernels.append(spec)
    rows = host_numel(ctx.types[linears[0].inputs[0]].shape[:-1])
    outs = ", ".join(n.outputs[0].name for n in linears)
    return [*_gemm_lines(ctx, linears, code),
            f"K.{spec.name}[({rows}, triton.cdiv({total}, {block}))]({TMP}, {outs}, BLOCK={block}, "
            f"num_warps={cfg['num_warps']})",
            f"del {TMP}"]


def merged_joint(ctx: GenContext, linears: list[Node], epilogue: list[Node], out_name: str, code: GroupCode) -> list[str]:
    """One GEMM of equal-N linears, then the epilogue reading each linear's columns of the temporary: a
    program per (row, block of columns), so each load is one contiguous run of a row."""
    n = int(ctx.types[linears[0].inputs[1]].shape[0])
    width = n * len(linears)
    out_t = ctx.types[out_name]
    body = lower_chain(epilogue, ctx.types, out_t.shape, IndexContext(full="offs", mask="mask"))
    column = {lin.outputs[0].name: i * n for i, lin in enumerate(linears)}
    cfg = ctx.cfg("pointwise")
    block = min(int(cfg["BLOCK"]), 1 << max(4, (n - 1).bit_length()))
    loads, params, args = [], [Param("c_ptr", ptr(linears[0].outputs[0].type.dtype))], [TMP]
    ptrs = ["c_ptr"]
    for op in body.operands:
        if op.value in column:  # a linear's output: its columns of the temporary
            loads.append(f"{op.var} = tl.load(c_ptr + row * {width} + {column[op.value]} + col, mask=mask, other=0)"
                         + ".to(tl.float32)")
        else:
            loads.append(load_line(op, f"{op.var}_ptr", "mask"))
            params.append(Param(f"{op.var}_ptr", ptr(op.dtype)))
            ptrs.append(f"{op.var}_ptr")
            args.append(op.value)
    params += [Param("out0_ptr", ptr(out_t.dtype)), Param("BLOCK", "constexpr")]
    ptrs.append("out0_ptr")
    ops = [e.op for e in epilogue]
    spec = make_kernel(
        "triton/pointwise.py.j2", "pointwise", "_".join(ops[:4]) + f"_cols{len(linears)}", params, {"BLOCK": block},
        cfg["num_warps"], doc=f"Fused pointwise: {' -> '.join(ops)}, over the columns of one [rows, {width}] GEMM output.",
        ptrs=ptrs, loads=loads, lines=body.lines, stores=[{"ptr": "out0_ptr", "var": body.results[out_name]}],
        out_shape=list(out_t.shape), cols=n)
    code.kernels.append(spec)
    rows = host_numel(out_t.shape[:-1])
    return [*_gemm_lines(ctx, linears, code),
            f"K.{spec.name}[({rows}, triton.cdiv({n}, {block}))]({', '.join(args)}, {out_name}, "
            f"BLOCK={block}, num_warps={cfg['num_warps']})",
            f"del {TMP}"]
