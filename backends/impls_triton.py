"""Triton implementations (CUDA, ROCm, Intel XPU): generated kernels, each with its lowering.

The lowering (codegen/kernels/*.py builders) turns a kernel group into kernels and launch
lines; ``accepts`` is what the fuse pass asks before it grows a group anchored on the
implementation, so every group the pass forms is one the lowering takes whole.
"""

from __future__ import annotations

from collections.abc import Mapping

from portlayer.backends.impls import Verdict, all_of, any_feature, codegen_is, implementation
from portlayer.capabilities.descriptor import Descriptor
from portlayer.codegen.expr import POINTWISE_OPS
from portlayer.codegen.kernels.attention import build_attention
from portlayer.codegen.kernels.embedding import build_embedding
from portlayer.codegen.kernels.gemm_group import accepts_gemm_group, build_gemm_group, gemm_group_scratch
from portlayer.codegen.kernels.pointwise import accepts_pointwise, build_pointwise
from portlayer.codegen.kernels.reduction import accepts_reduction, build_reduction
from portlayer.codegen.kernels.rope import accepts_rope, build_rope
from portlayer.codegen.spec import FLOAT_DTYPES, TL_DTYPE
from portlayer.flatten.ir import Node, TensorType
from portlayer.flatten.ops import all_ops

TRITON = codegen_is("triton")


def _dtype_has_throughput(d: Descriptor) -> Verdict:
    return (False, f"descriptor {d.name} lists no fp32 throughput") if d.tflops("float32") is None else (True, "")


def _float_out(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    dt = node.outputs[0].type.dtype
    return (True, "") if dt in FLOAT_DTYPES else (False, f"output dtype {dt} is not a float the template handles")


def _pointwise_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    if node.op not in POINTWISE_OPS:
        return False, f"{node.op} has no Triton expression (codegen/expr.py)"
    for v in [*node.inputs, node.outputs[0].name]:
        if v is not None and (types[v].dtype if v in types else node.outputs[0].type.dtype) not in TL_DTYPE:
            return False, f"dtype of {v} has no Triton spelling"
    return True, ""


def _last_dim_static(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    d = node.outputs[0].type.shape[-1] if node.outputs[0].type.rank else 1
    if not isinstance(d, int):
        return False, f"the normalised axis has symbolic size {d!r}; the row kernel needs a static BLOCK_N"
    if node.op == "softmax" and node.attrs.get("dim", -1) not in (-1, node.outputs[0].type.rank - 1):
        return False, "softmax over a non-last axis"
    return _float_out(node, types)


POINTWISE = sorted(n for n, d in all_ops().items() if d.kind == "pointwise" and n != "rope")
implementation(POINTWISE, name="triton.pointwise", family="triton", priority=50, supported=TRITON,
               supports=_pointwise_ok, accepts=accepts_pointwise, fusible=True, inplace=True)(build_pointwise)

implementation("rms_norm", name="triton.rms_norm", family="triton", priority=50, supported=TRITON,
               supports=_last_dim_static, accepts=accepts_reduction, fusible=True, inplace=True)(build_reduction)
implementation("layer_norm", name="triton.layer_norm", family="triton", priority=50, supported=TRITON,
               supports=_last_dim_static, accepts=accepts_reduction, fusible=True, inplace=True)(build_reduction)
implementation("softmax", name="triton.softmax", family="triton", priority=50, supported=TRITON,
               supports=_last_dim_static, accepts=accepts_reduction, fusible=True, inplace=True)(build_reduction)


def _rope_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    if node.attrs.get("style") not in ("neox", "gptj"):
        return False, f"rope style {node.attrs.get('style')!r} has no template"
    if node.attrs.get("rotary_dim", 0) % 2:
        return False, f"rotary_dim {node.attrs['rotary_dim']} is odd"
    t = types[node.inputs[0]]
    if t.rank != 3 or not all(isinstance(d, int) for d in t.shape[1:]):
        return False, f"rope input {t} is not [T, H, D] with static H and D"
    return _float_out(node, types)


implementation("rope", name="triton.rope", family="triton", priority=50, supported=TRITON, supports=_rope_ok,
               accepts=accepts_rope, fusible=True, inplace=True, kv_write=True)(build_rope)


def _embedding_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    w = types[node.inputs[0]]
    if w.rank != 2 or not isinstance(w.shape[1], int):
        return False, f"embedding table {w} is not [vocab, static width]"
    return _float_out(node, types)


implementation("embedding", name="triton.embedding", family="triton", priority=50, supported=TRITON,
               supports=_embedding_ok)(build_embedding)


def _gemm_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    x = types[node.inputs[0]]
    if x.rank != 2 or not isinstance(x.shape[1], int):
        return False, f"activation {x} is not [rows, static K]"
    if x.dtype not in FLOAT_DTYPES:
        return False, f"activation dtype {x.dtype} is not a float"
    return _float_out(node, types)


implementation("linear", name="triton.gemm", family="triton", priority=30,
               supported=all_of(TRITON, any_feature("tensor_cores", "matrix_cores", "xmx"), _dtype_has_throughput),
               supports=_gemm_ok, accepts=accepts_gemm_group, scratch=gemm_group_scratch, fusible=True,
               epilogue=True)(build_gemm_group)


def _wq_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    ok, why = _gemm_ok(node, types)
    if not ok:
        return ok, why
    bits, g = int(node.attrs.get("bits", 8)), int(node.attrs.get("group_size") or 0)
    tile = 32 if bits == 4 else 16
    if not g or g % tile:
        return False, f"group size {g} is not a multiple of {tile} (a K tile of the {bits}-bit kernel lies in one group)"
    return True, ""


implementation("linear_wq", name="triton.gemm_wq", family="triton", priority=30, supported=TRITON,
               supports=_wq_ok, accepts=accepts_gemm_group, scratch=gemm_group_scratch, fusible=True,
               epilogue=True)(build_gemm_group)


def _attn_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    d = node.attrs.get("head_dim", 0)
    if d > 256:
        return False, f"head_dim {d} > 256 does not fit the K/V tiles in shared memory"
    q, k, v = (types[i] for i in node.inputs[:3])
    if v.shape[-1] != q.shape[-1] or int(q.shape[1]) % int(k.shape[1]):
        return False, "the kernels want v's head_dim equal to q's and Hq a multiple of Hkv"
    if node.attrs.get("sliding_window") and not node.attrs.get("causal", True):
        return False, "a two-sided local window (bidirectional + sliding_window, ModernBERT) is not in the kernels' masks"
    return _float_out(node, types)


implementation("attention", name="triton.paged_attention", family="triton", priority=50, supported=TRITON,
               supports=_attn_ok, kv_from_rope=True)(build_attention)
