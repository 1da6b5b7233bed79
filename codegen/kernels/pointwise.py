"""Fused pointwise kernels: any chain of the registry's pointwise ops, written from the IR."""

from __future__ import annotations

from typing import Any

from portlayer.codegen.expr import IndexContext, Unsupported, load_line, lower_chain
from portlayer.codegen.kernels.context import GenContext, GroupCode, host_numel, make_kernel
from portlayer.codegen.spec import Param, ptr
from portlayer.flatten.ir import normalize_dim


def build_pointwise(ctx: GenContext, group: dict[str, Any], node_names: list[str] | None = None,
                    outputs: list[str] | None = None) -> GroupCode:
    nodes = [ctx.nodes[n] for n in (node_names or group["nodes"])]
    outputs = outputs or group["outputs"]
    out_shape = ctx.types[outputs[0]].shape
    if any([normalize_dim(d) for d in ctx.types[o].shape] != [normalize_dim(d) for d in out_shape] for o in outputs):
        raise Unsupported("pointwise group outputs differ in shape")
    body = lower_chain(nodes, ctx.types, out_shape, IndexContext(full="offs", mask="mask"))
    cfg = ctx.cfg("pointwise")
    ptrs = [f"{op.var}_ptr" for op in body.operands] + [f"out{i}_ptr" for i in range(len(outputs))]
    loads = [load_line(op, f"{op.var}_ptr", "mask") for op in body.operands]
    stores = [{"ptr": f"out{i}_ptr", "var": body.results[o]} for i, o in enumerate(outputs)]
    ops = [n.op for n in nodes]
    params = [Param(f"{op.var}_ptr", ptr(op.dtype)) for op in body.operands]
    params += [Param(f"out{i}_ptr", ptr(ctx.types[o].dtype)) for i, o in enumerate(outputs)]
    params += [Param("n_elements", "i32"), Param("BLOCK", "constexpr")]
    spec = make_kernel(
        "triton/pointwise.py.j2", "pointwise", "_".join(ops[:4]), params, {"BLOCK": cfg["BLOCK"]},
        cfg["num_warps"], doc=f"Fused pointwise: {' -> '.join(ops)}.", node_names=[n.name for n in nodes],
        ptrs=ptrs, loads=loads, lines=body.lines, stores=stores, out_shape=list(out_shape),
    )
    n = host_numel(out_shape)
    args = ", ".join([op.value for op in body.operands] + list(outputs))
    line = (f"K.{spec.name}[(triton.cdiv({n}, {cfg['BLOCK']}),)]({args}, {n}, "
            f"BLOCK={cfg['BLOCK']}, num_warps={cfg['num_warps']})")
    return GroupCode([spec], [line], list(outputs))
