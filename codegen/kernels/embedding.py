"""Embedding gather: one program copies one token's row of the table."""

from __future__ import annotations

from portlayer.codegen.kernels.context import GenContext, host_numel, make_kernel
from portlayer.codegen.lowering import GroupCode, KernelGroup
from portlayer.codegen.spec import Param, pow2, ptr, short_dtype


def build_embedding(ctx: GenContext, group: KernelGroup) -> GroupCode:
    (node,) = group.nodes
    weight, ids = node.inputs
    w_t, out = ctx.types[weight], node.outputs[0]
    n_cols = int(w_t.shape[1])
    block_n = min(pow2(n_cols), max(ctx.cfg("embedding")["BLOCK_N"], 1024))
    warps = ctx.row_warps("embedding", block_n, w_t.dtype)
    params = [Param("weight_ptr", ptr(w_t.dtype)), Param("ids_ptr", ptr(ctx.types[ids].dtype)),
              Param("out_ptr", ptr(out.type.dtype)), Param("n_tokens", "i32"), Param("N", "constexpr"),
              Param("BLOCK_N", "constexpr")]
    spec = make_kernel("triton/embedding.py.j2", "embedding", short_dtype(w_t.dtype), params,
                       {"N": n_cols, "BLOCK_N": block_n}, warps, doc="Embedding lookup.")
    n = host_numel(ctx.types[ids].shape)
    line = (f"K.{spec.name}[({n},)]({weight}, {ids}, {out.name}, {n}, N={n_cols}, BLOCK_N={block_n}, "
            f"num_warps={warps})")
    return GroupCode([spec], [line], [out.name])
