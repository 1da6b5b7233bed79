"""Collective implementations: ``all_reduce`` / ``all_gather`` as host-side torch.distributed calls
between kernels, over the default process group the launcher created with the descriptor's
``collectives`` backend (gloo on the CPU, NCCL / RCCL on GPUs).

- ``torch.distributed`` (torch family, torch codegen): the op's reference semantics, i.e. the
  functional collectives (a new tensor per call), inside the CPU program.
- ``torch.distributed_inplace`` (torch family, for Triton targets, like ``vendor_gemm``: a host call
  between the generated kernels, not a kernel): the collective runs *in place on the planned arena
  buffer* (``out.copy_(x); dist.all_reduce(out)``), no allocation per step, so a CUDA graph can
  capture it with NCCL. all_gather along the last dim goes through a [world * rows, cols] staging
  tensor (dist.all_gather_into_tensor gathers along dim 0 only), permuted into the planned buffer.
"""

from __future__ import annotations

from portlayer.backends.impls import Verdict, codegen_is, implementation
from portlayer.capabilities.descriptor import Descriptor
from portlayer.codegen.kernels.context import GenContext
from portlayer.codegen.kernels.fallback import build_reference
from portlayer.codegen.lowering import GroupCode, KernelGroup

COLLECTIVES = ("all_reduce", "all_gather")


def _has_collectives(d: Descriptor) -> Verdict:
    lib = d.raw.get("collectives", {}).get("library") if isinstance(d.raw.get("collectives"), dict) else None
    if not lib:
        return False, f"descriptor {d.name} lists no collectives library (field 'collectives')"
    return True, f"{lib} through torch.distributed"


def _torch_target(d: Descriptor) -> Verdict:
    ok, why = codegen_is("torch")(d)
    return (ok, why) if not ok else _has_collectives(d)


def _triton_target(d: Descriptor) -> Verdict:
    ok, why = codegen_is("triton")(d)
    return (ok, why) if not ok else _has_collectives(d)


implementation(COLLECTIVES, name="torch.distributed", family="torch", priority=20, supported=_torch_target)(
    build_reference)


@implementation(COLLECTIVES, name="torch.distributed_inplace", family="torch", priority=20, supported=_triton_target)
def host_collective(ctx: GenContext, group: KernelGroup) -> GroupCode:
    """The collective in place on the planned output buffer, between the kernels before and after it."""
    (n,) = group.nodes
    x, out = n.inputs[0], n.outputs[0].name
    world = int(n.attrs["world_size"])
    if n.op == "all_reduce":
        if world == 1:
            return GroupCode([], [f"{out}.copy_({x})"], [out])
        return GroupCode([], [f"{out}.copy_({x})", f"torch.distributed.all_reduce({out})"], [out])
    rank = ctx.types[x].rank
    axis = int(n.attrs["dim"]) % rank
    if world == 1:
        return GroupCode([], [f"{out}.copy_({x})"], [out])
    staged = f"{out}_parts"
    perm = ", ".join(str(i) for i in [*range(1, axis + 1), 0, *range(axis + 1, rank + 1)])
    lines = [  # ranks' pieces concatenated along dim 0 (the layout every backend accepts), then moved to `axis`
        f"{staged} = {x}.new_empty(({world} * {x}.shape[0],) + tuple({x}.shape[1:]))",
        f"(getattr(torch.distributed, 'all_gather_single', None) or torch.distributed.all_gather_into_tensor)"
        f"({staged}, {x}.contiguous())",  # renamed in torch 2.13; the same call
        f"{out}.copy_({staged}.view(({world},) + tuple({x}.shape)).permute({perm}).reshape({out}.shape))" if axis else
        f"{out}.copy_({staged}.reshape({out}.shape))",
    ]
    return GroupCode([], lines, [out])
