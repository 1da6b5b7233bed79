"""CANN implementations (Ascend): torch_npu / aclnn calls as vllm-ascend issues them.

Facts (signatures, layouts, limits) come from ../shared/reference/ascend-ops.md; the section
is cited on each registration. Fused vendor ops (npu_add_rms_norm, npu_mrope, npu_swiglu)
realise several portable nodes in one call, so they carry a ``match`` that names the nodes
they absorb. None of these calls is ``fusible``: each is one opaque vendor kernel.
"""

from __future__ import annotations

from collections.abc import Mapping

from portlayer.backends.impls import GraphView, Verdict, codegen_is, find, implementation, needs_feature
from portlayer.codegen import cann as C
from portlayer.codegen.kernels.context import GenContext
from portlayer.codegen.lowering import GroupCode, KernelGroup
from portlayer.flatten.ir import Node, TensorType
from portlayer.flatten.ops import all_ops

CANN = codegen_is("cann")
HALF = ("float16", "bfloat16")
VIEW_OPS = {n for n, d in all_ops().items() if d.kind == "view"}


# ---- generic aclnn ops (torch ops on the NPU dispatch to aclnnAdd, aclnnMatmul, ...) -----------------

POINTWISE = sorted(n for n, d in all_ops().items() if d.kind == "pointwise" and n != "rope")
implementation(POINTWISE, name="cann.elementwise", family="cann", priority=40, supported=CANN)(
    C.cann_lowering(C.emit_elementwise))
implementation(("rms_norm", "layer_norm", "softmax", "l2_normalize", "sum", "mean", "amax", "amin"), name="cann.aclnn_reduction",
               family="cann", priority=40, supported=CANN)(C.cann_lowering(C.emit_torch_op))
# ascend-ops.md table: unquantized linear is torch.nn.functional.linear(x, W[out,in], b) (ops/linear.py:58).
implementation(("linear", "matmul"), name="cann.linear", family="cann", priority=40, supported=CANN)(
    C.cann_lowering(C.emit_linear))


# ---- rms_norm: §1 npu_rms_norm, §2 npu_add_rms_norm ----------------------------------------------------


def _norm_dtypes(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    x, w = types[node.inputs[0]], types.get(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
    if w is None:
        return False, "npu_rms_norm needs a gamma tensor; this rms_norm has no weight"
    ok = {("float16", "float32"), ("bfloat16", "float32"), ("float16", "float16"), ("bfloat16", "bfloat16"),
          ("float32", "float32")}
    if (x.dtype, w.dtype) not in ok:
        return False, f"(x, gamma) dtypes ({x.dtype}, {w.dtype}) are not accepted on A2 (ascend-ops.md §1)"
    return True, ""


implementation("rms_norm", name="cann.npu_rms_norm", family="cann", priority=50,
               supported=needs_feature("fused_rms_norm", codegen="cann"), supports=_norm_dtypes)(
    C.cann_lowering(C.emit_rms_norm))


def _match_add_rms_norm(node: Node, view: GraphView) -> tuple[list[str] | None, str]:
    add = view.producer(node.inputs[0])
    if add is None or add.op != "add":
        return None, f"input {node.inputs[0]} is not produced by an add (no residual to fuse)"
    if len(add.inputs) < 2 or add.inputs[1] is None:
        return None, f"{add.name} adds a scalar, not a residual tensor"
    a, b, x = (view.types[add.inputs[0]], view.types[add.inputs[1]], view.types[node.inputs[0]])
    if not (a.shape == b.shape == x.shape):
        return None, f"{add.name} broadcasts ({a} + {b}); npu_add_rms_norm needs x1 and x2 of one shape"
    w = view.types.get(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
    if w is None or not (a.dtype == b.dtype == w.dtype):
        return None, "x1, x2 and gamma must share one dtype (ascend-ops.md §2)"
    if node.attrs.get("weight_offset"):
        return None, "weight_offset needs gamma + offset first; npu_add_rms_norm takes gamma as is"
    return [add.name], ""


implementation("rms_norm", name="cann.npu_add_rms_norm", family="cann", priority=60,
               supported=needs_feature("fused_add_rms_norm", codegen="cann"), match=_match_add_rms_norm)(
    C.cann_lowering(C.emit_add_rms_norm))


# ---- rope: §3 ------------------------------------------------------------------------------------------


def _through_views_down(view: GraphView, value: str) -> list[tuple[Node, int]]:
    out: list[tuple[Node, int]] = []
    for u in view.users(value):
        if u.op in VIEW_OPS:
            out += _through_views_down(view, u.outputs[0].name)
        else:
            out += [(u, i) for i, x in enumerate(u.inputs) if x == value]
    return out


def _through_views_up(view: GraphView, value: str) -> Node | None:
    p = view.producer(value)
    while p is not None and p.op in VIEW_OPS:
        p = view.producer(p.inputs[0])
    return p


def rope_partner(node: Node, view: GraphView) -> tuple[Node | None, str]:
    """The rope on the other attention operand (q for k, k for q) with the same table and positions."""
    uses = [(u, i) for u, i in _through_views_down(view, node.outputs[0].name) if u.op == "attention" and i in (0, 1)]
    if not uses:
        return None, f"{node.name} does not feed an attention q/k input"
    attn, idx = uses[0]
    other = _through_views_up(view, attn.inputs[1 - idx])
    if other is None or other.op != "rope":
        return None, f"the other operand of {attn.name} is not rotated by a rope node"
    if other.inputs[1:] != node.inputs[1:] or other.attrs != node.attrs:
        return None, f"{other.name} uses different positions, table or attrs than {node.name}"
    return other, ""


def _match_pair(node: Node, view: GraphView) -> tuple[list[str] | None, str]:
    other, why = rope_partner(node, view)
    if other is None:
        return None, why
    order = [n.name for n in view.graph.nodes]
    if order.index(other.name) > order.index(node.name):
        return None, f"pairs with the later rope {other.name}, which carries the call"
    return [other.name], ""


def _mrope_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    dt = node.outputs[0].type.dtype
    mult = 16 if dt == "float32" else 32
    hd, rd = node.attrs.get("head_dim") or types[node.inputs[0]].shape[-1], node.attrs.get("rotary_dim")
    if hd % mult or rd % mult:
        return False, f"head_size {hd} / rotary_dim {rd} must be multiples of {mult} for {dt} (ascend-ops.md §3 npu_mrope)"
    return True, ""


implementation("rope", name="cann.npu_mrope", family="cann", priority=60,
               supported=needs_feature("fused_rope", codegen="cann"), supports=_mrope_ok, match=_match_pair)(C.cann_lowering(C.emit_rope))


def _rot_emb_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    if node.attrs.get("style") not in ("neox", "gptj"):
        return False, f"style {node.attrs.get('style')!r} is neither neox nor gptj"
    return True, ""


implementation("rope", name="cann._npu_rotary_embedding", family="cann", priority=50,
               supported=needs_feature("fused_rope", codegen="cann"), supports=_rot_emb_ok, match=_match_pair,
               inplace=True)(C.cann_lowering(C.emit_rope))


def _rotary_mul_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    d = types[node.inputs[0]].shape[-1]
    if node.attrs.get("rotary_dim") != d:
        return False, f"partial rotary ({node.attrs.get('rotary_dim')} of {d}) needs a slice and concat around the call"
    if not isinstance(d, int) or d % 2 or d >= 896:
        return False, f"D={d} must be even and < 896 (ascend-ops.md §3 npu_rotary_mul)"
    return True, ""


implementation("rope", name="cann.npu_rotary_mul", family="cann", priority=40,
               supported=needs_feature("fused_rope", codegen="cann"), supports=_rotary_mul_ok)(C.cann_lowering(C.emit_not_generated))


# ---- silu * mul: §4 npu_swiglu -------------------------------------------------------------------------


def _match_swiglu(node: Node, view: GraphView) -> tuple[list[str] | None, str]:
    if len(node.inputs) < 2 or node.inputs[1] is None:
        return None, "mul by a scalar"
    for gi in (0, 1):
        silu = view.producer(node.inputs[gi])
        if silu is None or silu.op != "silu":
            continue
        a, b = view.producer(silu.inputs[0]), view.producer(node.inputs[1 - gi])
        halves = (a is not None and b is not None and a.op == b.op == "slice" and a.inputs[0] == b.inputs[0]
                  and a.attrs.get("start") == 0 and b.attrs.get("start") == a.attrs.get("end"))
        if not halves:
            return None, (f"npu_swiglu needs gate and up as the two halves of one tensor (a merged gate_up "
                          f"projection); here they are {silu.inputs[0]} and {node.inputs[1 - gi]}")
        return [silu.name], ""
    return None, "neither operand is silu(gate)"


implementation("mul", name="cann.npu_swiglu", family="cann", priority=60,
               supported=needs_feature("fused_swiglu", codegen="cann"), match=_match_swiglu)(
    C.cann_lowering(C.emit_swiglu))


# ---- attention: §6, §7 ---------------------------------------------------------------------------------


def _lower_attention(ctx: GenContext, group: KernelGroup) -> GroupCode:
    """KV write + decode through _npu_paged_attention where it accepts the node, prefill through FIA."""
    def emit(g: C.CannState, n: Node, grp: KernelGroup) -> None:
        pa = find("cann._npu_paged_attention", "attention")
        pa_ok, pa_why = pa.supports(n, g.types) if pa is not None else (False, "not registered")
        C.emit_attention(g, n, grp, bool(pa_ok), pa_why)

    emit.__name__ = "emit_attention"
    return C.cann_lowering(emit)(ctx, group)



def _fia_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    dt, d = node.outputs[0].type.dtype, node.attrs.get("head_dim")
    if dt not in HALF:
        return False, f"{dt} q/k/v: FIA takes fp16/bf16 (ascend-ops.md §7)"
    if d not in (64, 128, 192):
        return False, f"head_dim {d}: TND layout takes 64/128/192 (ascend-ops.md §7; CANN-version dependent)"
    if node.attrs.get("num_heads", 1) > 256 or node.attrs.get("softcap"):
        return False, "more than 256 heads or a softcap"
    return True, ""


implementation("attention", name="cann.npu_fused_infer_attention_score", family="cann", priority=60,
               supported=needs_feature("flash_attention", codegen="cann"), supports=_fia_ok)(_lower_attention)


def _pa_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    dt, d = node.outputs[0].type.dtype, node.attrs.get("head_dim")
    if dt not in HALF:
        return False, f"{dt} query: _npu_paged_attention takes fp16/bf16 (ascend-ops.md §6)"
    if not 0 < d <= 256:
        return False, f"head_size {d} is outside (0, 256] (ascend-ops.md §6)"
    if node.attrs.get("sliding_window") or node.attrs.get("softcap") or not node.attrs.get("causal", True):
        return False, "sliding window, softcap or bidirectional attention (maskType UNDEFINED only)"
    return True, ""


implementation("attention", name="cann._npu_paged_attention", family="cann", priority=50,
               supported=needs_feature("paged_attention", codegen="cann"), supports=_pa_ok)(_lower_attention)


# ---- weight-only quantized linear: §9 -------------------------------------------------------------------


def _wq_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    x = types[node.inputs[0]]
    k, g = x.shape[-1], node.attrs.get("group_size")
    n = node.outputs[0].type.shape[-1]
    if x.dtype not in HALF:
        return False, f"x is {x.dtype}; npu_weight_quant_batchmatmul takes fp16/bf16 (ascend-ops.md §9)"
    if g != k and (g % 32 or not 32 <= g <= k - 1):
        return False, f"group size {g} must be a multiple of 32 in [32, K-1={k - 1}] (ascend-ops.md §9)"
    if k > 65535 or n > 65535:
        return False, f"K={k}, N={n} must be <= 65535"
    return True, ""


implementation("linear_wq", name="cann.npu_weight_quant_batchmatmul", family="cann", priority=60,
               supported=needs_feature("weight_quant_matmul", codegen="cann"), supports=_wq_ok)(
    C.cann_lowering(C.emit_not_generated))
