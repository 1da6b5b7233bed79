"""Fused pointwise kernels: any chain of the registry's pointwise ops, written from the IR."""

from __future__ import annotations

from portlayer.codegen.expr import IndexContext, Unsupported, load_line, lower_chain
from portlayer.codegen.kernels.context import GenContext, host_numel, make_kernel
from portlayer.codegen.lowering import GroupCode, GroupQuery, KernelGroup
from portlayer.codegen.spec import Param, ptr
from portlayer.flatten.ir import Node, normalize_dim


def accepts_pointwise(query: GroupQuery, nodes: list[Node]) -> tuple[bool, str]:
    """One iteration shape, and every op and broadcast expressible in the generated chain."""
    shapes = {tuple(normalize_dim(d) for d in n.outputs[0].type.shape) for n in nodes}
    if len(shapes) != 1:
        return False, f"pointwise nodes iterate over different shapes {sorted(map(str, shapes))}"
    try:
        lower_chain(nodes, query.types, nodes[-1].outputs[0].type.shape, IndexContext(full="offs", mask="mask"))
    except Unsupported as e:
        return False, f"the pointwise template cannot express it: {e}"
    return True, ""


def build_pointwise(ctx: GenContext, group: KernelGroup, nodes: list[Node] | None = None,
                    outputs: list[str] | None = None) -> GroupCode:
    nodes = nodes or group.nodes
    outputs = outputs or group.outputs
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
        cfg["num_warps"], doc=f"Fused pointwise: {' -> '.join(ops)}.", ptrs=ptrs, loads=loads, lines=body.lines, stores=stores, out_shape=list(out_shape), cols=0,
    )
    n = host_numel(out_shape)
    args = ", ".join([op.value for op in body.operands] + list(outputs))
    line = (f"K.{spec.name}[(triton.cdiv({n}, {cfg['BLOCK']}),)]({args}, {n}, "
            f"BLOCK={cfg['BLOCK']}, num_warps={cfg['num_warps']})")
    return GroupCode([spec], [line], list(outputs))
