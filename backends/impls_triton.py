"""Triton implementations (CUDA, ROCm, Intel XPU): generated kernels from codegen/templates/triton.

Each registration names the template family codegen renders; all are ``fusible`` (codegen can
inline them into a larger kernel), and ``triton.gemm`` takes pointwise epilogues.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portlayer.backends.impls import Verdict, all_of, any_feature, codegen_is, implementation
from portlayer.capabilities.descriptor import Descriptor
from portlayer.flatten.ir import Node, TensorType
from portlayer.flatten.ops import all_ops

TRITON = codegen_is("triton")
FLOATS = ("float32", "float16", "bfloat16")


def _dtype_has_throughput(d: Descriptor) -> Verdict:
    missing = [dt for dt in ("float32",) if d.tflops(dt) is None]
    return (False, f"descriptor {d.name} lists no fp32 throughput") if missing else (True, "")


def _float_out(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    dt = node.outputs[0].type.dtype
    return (True, "") if dt in FLOATS else (False, f"output dtype {dt} is not a float the template handles")


def _last_dim_static(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    d = node.outputs[0].type.shape[-1] if node.outputs[0].type.rank else 1
    if not isinstance(d, int):
        return False, f"the normalised axis has symbolic size {d!r}; the row kernel needs a static BLOCK_N"
    return True, ""


def _template(name: str):
    def emit(node: Node, types: Mapping[str, TensorType] | None = None) -> dict[str, Any]:
        return {"template": f"triton/{name}.py.j2"}

    return emit


POINTWISE = sorted(n for n, d in all_ops().items() if d.kind == "pointwise" and n != "rope")
implementation(POINTWISE, name="triton.pointwise", family="triton", priority=50, supported=TRITON,
               fusible=True, inplace=True)(_template("pointwise"))

implementation("rms_norm", name="triton.rms_norm", family="triton", priority=50, supported=TRITON,
               supports=_last_dim_static, fusible=True, inplace=True)(_template("rms_norm"))
implementation("layer_norm", name="triton.layer_norm", family="triton", priority=50, supported=TRITON,
               supports=_last_dim_static, fusible=True, inplace=True)(_template("layer_norm"))
implementation(("softmax", "l2_normalize"), name="triton.row_reduction", family="triton", priority=50,
               supported=TRITON, supports=_last_dim_static, fusible=True, inplace=True)(_template("row_reduction"))
implementation(("sum", "mean", "amax", "amin"), name="triton.reduction", family="triton", priority=50,
               supported=TRITON, fusible=False)(_template("reduction"))


def _rope_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    if node.attrs.get("style") not in ("neox", "gptj"):
        return False, f"rope style {node.attrs.get('style')!r} has no template"
    if node.attrs.get("rotary_dim", 0) % 2:
        return False, f"rotary_dim {node.attrs['rotary_dim']} is odd"
    return True, ""


implementation("rope", name="triton.rope", family="triton", priority=50, supported=TRITON, supports=_rope_ok,
               fusible=True, inplace=True)(_template("rope"))

implementation("embedding", name="triton.embedding", family="triton", priority=50, supported=TRITON,
               fusible=False)(_template("embedding"))


def _gemm_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    ok, why = _float_out(node, types)
    if not ok:
        return ok, why
    if node.op == "matmul" and types[node.inputs[0]].rank != 2:
        return False, "batched matmul has no template; the vendor BLAS handles it"
    return True, ""


implementation(("linear", "matmul"), name="triton.gemm", family="triton", priority=30,
               supported=all_of(TRITON, any_feature("tensor_cores", "matrix_cores", "xmx"), _dtype_has_throughput),
               supports=_gemm_ok, fusible=True, epilogue=True)(_template("gemm"))


def _wq_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    g, k = node.attrs.get("group_size"), types[node.inputs[0]].shape[-1]
    if isinstance(k, int) and g and g != k and g % 16:
        return False, f"group size {g} is not a multiple of 16 (BLOCK_K must hold whole groups)"
    return True, ""


implementation("linear_wq", name="triton.gemm_wq", family="triton", priority=30, supported=TRITON,
               supports=_wq_ok, fusible=True, epilogue=True)(_template("gemm_wq"))


def _attn_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    d = node.attrs.get("head_dim", 0)
    if d > 256:
        return False, f"head_dim {d} > 256 does not fit the K/V tiles in shared memory"
    return True, ""


implementation("attention", name="triton.paged_attention", family="triton", priority=50, supported=TRITON,
               supports=_attn_ok, fusible=False)(_template("paged_attention"))
