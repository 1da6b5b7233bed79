"""torch implementations: every op on a torch-codegen target (the CPU), host-side data ops and
views everywhere, the vendor GEMM (cuBLAS / hipBLASLt / oneDNN through torch.nn.functional), and
``reference``: the op's semantics through torch when select found nothing else (never chosen by
priority; select records it with a warning)."""

from __future__ import annotations

from collections.abc import Mapping

from portlayer.backends.impls import Verdict, codegen_is, implementation
from portlayer.capabilities.descriptor import Descriptor
from portlayer.codegen.kernels.context import GenContext
from portlayer.codegen.kernels.fallback import build_reference, build_view
from portlayer.codegen.lowering import GroupCode, KernelGroup
from portlayer.flatten.ir import Node, TensorType
from portlayer.flatten.ops import all_ops

COMPUTE_KINDS = ("pointwise", "reduction", "gemm", "attention")


def _everywhere(d: Descriptor) -> Verdict:
    return True, "data movement, creation and views run as torch tensor ops on every backend"


def _never(d: Descriptor) -> Verdict:
    return False, "the reference fallback is recorded by select only when nothing else accepts a node"


def _register_all() -> None:
    for name, opdef in sorted(all_ops().items()):
        implementation(name, name="reference", family="torch", priority=-1, supported=_never, fallback=True)(
            build_reference)
        if opdef.kind == "view":
            implementation(name, name="torch.view", family="torch", priority=100, supported=_everywhere,
                           inplace=False)(build_view)
        elif opdef.kind in COMPUTE_KINDS:
            implementation(name, name=f"torch.{name}", family="torch", priority=0,
                           supported=codegen_is("torch"))(build_reference)
        else:
            implementation(name, name=f"torch.{name}", family="torch", priority=0, supported=_everywhere)(build_reference)


_register_all()


def _vendor_blas(d: Descriptor) -> Verdict:
    if d.codegen == "torch":
        return False, "torch codegen already runs torch.linear (registered as torch.linear)"
    if d.codegen == "cann":
        return False, "CANN targets call the linear through torch_npu (cann.linear)"
    return True, f"{d.vendor} BLAS through torch"


def _sdpa_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    if node.attrs.get("softcap"):
        return False, "scaled_dot_product_attention has no logit softcap (the reference runs it)"
    return True, ""


@implementation("attention", name="torch.sdpa", family="torch", priority=5, supported=codegen_is("torch"),
                supports=_sdpa_ok)
def torch_sdpa(ctx: GenContext, group: KernelGroup) -> GroupCode:
    """Every sequence of the step in one batched scaled_dot_product_attention (codegen/torch_attention.py)."""
    (n,) = group.nodes
    a = n.attrs
    q, k, v = n.inputs[:3]
    line = (f"{n.outputs[0].name} = attention_batched({q}, {k}, {v}, st, layer={a.get('layer', 0)}, "
            f"scale={a.get('scale')!r}, causal={bool(a.get('causal', True))}, "
            f"sliding_window={a.get('sliding_window')!r})")
    return GroupCode([], [line], [])


@implementation(("linear", "matmul"), name="vendor_gemm", family="torch", priority=10, supported=_vendor_blas)
def vendor_gemm(ctx: GenContext, group: KernelGroup) -> GroupCode:
    """The device's BLAS (cuBLAS, hipBLASLt, oneDNN) through torch, into the planned buffer."""
    (n,) = group.nodes
    out = n.outputs[0].name
    if n.op == "matmul":
        return GroupCode([], [f"torch.matmul({n.inputs[0]}, {n.inputs[1]}, out={out})"], [out])
    x, w = n.inputs[0], n.inputs[1]
    bias = n.inputs[2] if len(n.inputs) > 2 else None
    k, m = ctx.types[w].shape[1], ctx.types[w].shape[0]
    if ctx.types[x].rank != 2:  # rows of a higher-rank activation: 2-D views, no copies
        x, dst = f"{x}.reshape(-1, {k})", f"{out}.view(-1, {m})"
    else:
        dst = out
    line = (f"torch.addmm({bias}, {x}, W_T({w}), out={dst})" if bias else f"torch.mm({x}, W_T({w}), out={dst})")
    return GroupCode([], [line], [out])


PACK_MAX_BYTES = 4 * 2**20  # a packed copy doubles the weight's memory: small weights only (MiniLM's <= 2.4 MB)


def _mkl_packable(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    w, x = types[node.inputs[1]], types[node.inputs[0]]
    if w.dtype != "float32" or x.dtype != "float32" or node.outputs[0].type.dtype != "float32":
        return False, f"MKL's packed sgemm is float32; this linear is {x.dtype} x {w.dtype}"
    if w.rank != 2 or not all(isinstance(d, int) for d in w.shape):
        return False, f"the weight {w} is not a static 2-D matrix"
    if w.nbytes({}) > PACK_MAX_BYTES:
        return False, f"weight of {w.nbytes({}) / 2**20:.1f} MiB > {PACK_MAX_BYTES >> 20} MiB: a packed copy would double it"
    if x.rank != 2 or not isinstance(x.shape[1], int):
        return False, f"the packed GEMM takes a [rows, K] activation, not {x}"
    return True, ""


def _x86_torch(d: Descriptor) -> Verdict:
    ok, why = codegen_is("torch")(d)
    if not ok:
        return ok, why
    if d.arch not in ("x86_64", "AMD64"):
        return False, f"MKL's packed sgemm is an x86-64 library; {d.name} is {d.arch}"
    return True, "MKL packed sgemm (x86-64 torch builds ship MKL)"


@implementation("linear", name="torch.mkl_packed", family="torch", priority=5, supported=_x86_torch,
                supports=_mkl_packable)
def mkl_packed_linear(ctx: GenContext, group: KernelGroup) -> GroupCode:
    """The weight packed once for MKL, then one packed GEMM with the bias per step (codegen/torch_linear.py)."""
    (n,) = group.nodes
    bias = n.inputs[2] if len(n.inputs) > 2 and n.inputs[2] is not None else "None"
    return GroupCode([], [f"{n.outputs[0].name} = packed_linear({n.inputs[0]}, {n.inputs[1]}, {bias})"], [])
