"""Triton implementations of the DeepSeek-era ops: the fused MoE kernels (codegen/kernels/moe.py)
for ``moe_experts``, and ``mla_attention`` over its latent cache (codegen/kernels/mla.py). On the
CPU both run the op's reference through impls_torch."""

from __future__ import annotations

from collections.abc import Mapping

from portlayer.backends.impls import Verdict, codegen_is, implementation
from portlayer.codegen.kernels.mla import lower_mla
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


def _mla_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    a = node.attrs
    width = int(a["kv_lora_rank"]) + int(a["qk_rope_head_dim"])
    if width > 256:
        return False, (f"a cache entry of {width} (kv_lora_rank + rope) > 256 does not fit the paged kernels' K/V tiles; "
                       "a dedicated MLA decode kernel is not written yet")
    if int(a["num_heads"]) > 64:
        return False, f"{a['num_heads']} heads over one latent KV head exceed the decode kernel's 64-row head tile"
    dt = node.outputs[0].type.dtype
    if dt not in FLOAT_DTYPES or types[node.inputs[1]].dtype != dt:
        return False, f"output {dt} and latent {types[node.inputs[1]].dtype} must be one float dtype"
    return True, ""


implementation("mla_attention", name="triton.mla_attention", family="triton", priority=50,
               supported=codegen_is("triton"), supports=_mla_ok)(lower_mla)
