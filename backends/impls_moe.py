"""Mixture-of-experts implementations: the fused MoE Triton kernels (codegen/kernels/moe.py) as
the Triton lowering of ``moe_experts``. The torch (CPU) path is the op's reference through
impls_torch; CANN's grouped-matmul calls are in impls_cann_moe.py."""

from __future__ import annotations

from collections.abc import Mapping

from portlayer.backends.impls import Verdict, codegen_is, implementation
from portlayer.codegen.kernels.moe import lower_moe
from portlayer.codegen.spec import FLOAT_DTYPES
from portlayer.flatten.ir import Node, TensorType
from portlayer.flatten.op_defs.moe import ACTIVATIONS


def _moe_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    x, ids, w, gu, down = (types[i] for i in node.inputs)
    if x.rank != 2 or not isinstance(x.shape[1], int):
        return False, f"activation {x} is not [tokens, static hidden]"
    if not all(isinstance(d, int) for d in (*ids.shape[1:], *gu.shape, *down.shape)):
        return False, "expert weights and top_k must have static sizes"
    if x.dtype not in FLOAT_DTYPES or gu.dtype != x.dtype or down.dtype != x.dtype:
        return False, f"activation {x.dtype} and expert weights {gu.dtype}/{down.dtype} must be one float dtype"
    if w.dtype not in FLOAT_DTYPES:
        return False, f"routing weights {w.dtype} are not a float"
    if node.attrs.get("activation", "silu") not in ACTIVATIONS:
        return False, f"activation {node.attrs.get('activation')!r} has no fused form"
    if int(gu.shape[1]) != 2 * int(down.shape[2]) or int(gu.shape[2]) != int(x.shape[1]):
        return False, f"w_gate_up {gu} is not [E, 2 x {down.shape[2]}, {x.shape[1]}]"
    return True, ""


implementation("moe_experts", name="triton.fused_moe", family="triton", priority=50, supported=codegen_is("triton"),
               supports=_moe_ok)(lower_moe)
