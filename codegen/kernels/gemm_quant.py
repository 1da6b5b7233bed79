"""Weight-only quantized linears (``linear_wq``) in the GEMM lowering: the layout siblings must share,
and the path from ``tuning.wq_vendor_min_tokens`` rows (codegen/gemm_rule.py): one launch dequantizes the
weight into a temporary in the activation's dtype (as the op's semantics round it), then the vendor GEMM.
The temporary is freed after the group, so the caching allocator hands the same block to the next layer
(no float copy is kept per layer), and under CUDA graph capture it comes from the graph's pool.
"""

from __future__ import annotations

from typing import Any

from portlayer.codegen.kernels.context import GenContext, make_kernel
from portlayer.codegen.kernels.pointwise import build_pointwise
from portlayer.codegen.lowering import GroupCode, KernelGroup
from portlayer.codegen.spec import Param, ptr, short_dtype
from portlayer.flatten.ir import Node


def bias_of(n: Node) -> str | None:
    """The bias input of a linear (inputs[2]) or linear_wq (inputs[3]), if any."""
    i = 3 if n.op == "linear_wq" else 2
    return n.inputs[i] if len(n.inputs) > i and n.inputs[i] is not None else None


def quant_layout(n: Node, types: Any) -> tuple[Any, ...] | None:
    """What a shared few-rows launch needs equal across its weights: (bits, group size, offsets,
    scale dtype) of a linear_wq; None for a float linear."""
    if n.op != "linear_wq":
        return None
    off = n.inputs[4] if len(n.inputs) > 4 else None
    return (int(n.attrs["bits"]), int(n.attrs["group_size"]), off is not None, types[n.inputs[2]].dtype)


def layout_text(n: Node, lay: tuple[Any, ...] | None) -> str:
    return f"{n.name} is {'float' if lay is None else f'{lay[0]}-bit, group {lay[1]}' + (', offsets' if lay[2] else '')}"


def dequant_vendor(ctx: GenContext, group: KernelGroup, code: GroupCode) -> list[str]:
    """linear_wq above tuning.wq_vendor_min_tokens: dequantize W into a temporary in the activation's dtype
    (as the op's semantics round it), the vendor GEMM, then the epilogue as one pointwise kernel."""
    lin, epi = group.nodes[0], group.nodes[1:]
    x, qw, sc = lin.inputs[:3]
    bias, off = bias_of(lin), (lin.inputs[4] if len(lin.inputs) > 4 else None)
    n, k = int(ctx.types[qw].shape[0]), int(ctx.types[x].shape[-1])
    bits, gsize = int(lin.attrs["bits"]), int(lin.attrs["group_size"])
    quant = {"bits": bits, "offsets": off is not None}
    cfg = ctx.cfg("dequant")  # the Plan's launch.dequant (capabilities/policy.py)
    bn, bk, warps = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    params = [Param("q_ptr", ptr(ctx.types[qw].dtype)), Param("s_ptr", ptr(ctx.types[sc].dtype))]
    params += [Param("o_ptr", ptr(ctx.types[off].dtype))] if off else []
    params += [Param("w_ptr", ptr(ctx.types[x].dtype))] + [Param(c, "constexpr") for c in ("N", "K", "G", "BLOCK_N", "BLOCK_K")]
    const = {"N": n, "K": k, "G": gsize, "BLOCK_N": bn, "BLOCK_K": bk}
    variant = f"w{bits}{'a' if off else ''}_" + short_dtype(ctx.types[x].dtype)
    spec = make_kernel("triton/gemm_dequant.py.j2", "dequant", variant, params, const, warps, 1, quant=quant,
                       doc="A weight-only quantized weight dequantized for the vendor GEMM.")
    code.kernels.append(spec)
    lin_out = lin.outputs[0].name
    args = ", ".join([qw, sc, *([off] if off else []), "wq_tmp"])
    lines = [f"wq_tmp = torch.empty(({n}, {k}), dtype={x}.dtype, device={x}.device)",
             f"K.{spec.name}[(triton.cdiv({n}, {bn}), triton.cdiv({k}, {bk}))]({args}, N={n}, K={k}, G={gsize}, "
             f"BLOCK_N={bn}, BLOCK_K={bk}, num_warps={warps})",
             f"torch.addmm({bias}, {x}, W_T(wq_tmp), out={lin_out})" if bias else f"torch.mm({x}, W_T(wq_tmp), out={lin_out})",
             "del wq_tmp  # freed here: the next layer's temporary reuses the block"]
    if epi:
        out_name = epi[-1].outputs[0].name
        pw = build_pointwise(ctx, group, epi, [out_name])
        code.kernels += pw.kernels
        lines += pw.lines
        code.buffers = list(dict.fromkeys([*code.buffers, lin_out, out_name]))
    return lines
