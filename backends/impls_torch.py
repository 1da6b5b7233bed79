"""torch implementations: every op on a torch-codegen target (the CPU), host-side data ops and
views everywhere, and the vendor GEMM (cuBLAS / hipBLASLt / oneDNN through torch.nn.functional)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portlayer.backends.impls import Verdict, codegen_is, implementation
from portlayer.capabilities.descriptor import Descriptor
from portlayer.flatten.ir import Node, TensorType
from portlayer.flatten.ops import all_ops

COMPUTE_KINDS = ("pointwise", "reduction", "gemm", "attention")


def _everywhere(d: Descriptor) -> Verdict:
    return True, "data movement, creation and views run as torch tensor ops on every backend"


def _emit_torch(node: Node, types: Mapping[str, TensorType] | None = None) -> dict[str, Any]:
    return {"call": f"portlayer.flatten.ops.get_op({node.op!r}).reference"}


def _register_all() -> None:
    for name, opdef in sorted(all_ops().items()):
        if opdef.kind == "view":
            implementation(name, name="torch.view", family="torch", priority=100, supported=_everywhere,
                           inplace=False)(_emit_torch)
        elif opdef.kind in COMPUTE_KINDS:
            implementation(name, name=f"torch.{name}", family="torch", priority=0,
                           supported=codegen_is("torch"))(_emit_torch)
        else:
            implementation(name, name=f"torch.{name}", family="torch", priority=0, supported=_everywhere)(_emit_torch)


_register_all()


def _vendor_blas(d: Descriptor) -> Verdict:
    if d.codegen == "torch":
        return False, "torch codegen already runs torch.linear (registered as torch.linear)"
    if d.codegen == "cann":
        return False, "CANN targets call the linear through torch_npu (cann.linear)"
    return True, f"{d.vendor} BLAS through torch.nn.functional.linear"


@implementation(("linear", "matmul"), name="vendor_gemm", family="torch", priority=10, supported=_vendor_blas)
def vendor_gemm(node: Node, types: Mapping[str, TensorType] | None = None) -> dict[str, Any]:
    """The device's BLAS (cuBLAS, hipBLASLt, oneDNN) through torch: no epilogue fusion."""
    return {"call": "torch.nn.functional.linear" if node.op == "linear" else "torch.matmul"}
