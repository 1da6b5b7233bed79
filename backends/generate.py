"""Codegen through the lowering registry: each kernel group becomes code by the lowering of the
implementation the fuse pass named for it. This is the only place a group meets its lowering."""

from __future__ import annotations

from typing import Any

from portlayer.backends.impls import find
from portlayer.codegen.host import GeneratedProgram, generate_program
from portlayer.codegen.kernels.context import GenContext
from portlayer.codegen.lowering import GroupCode, KernelGroup, Unlowerable
from portlayer.flatten.ir import Graph


def lower_group(ctx: GenContext, group: KernelGroup) -> GroupCode:
    """Call the lowering of ``group.impl`` (the implementation select chose for its anchor node)."""
    anchor = ctx.nodes[group.anchor]
    impl = find(group.impl, anchor.op)
    if impl is None or impl.lower is None:
        raise Unlowerable(f"group {group.name}: implementation {group.impl!r} of {anchor.op!r} is not registered "
                          "with a lowering (backends/impls_*.py)")
    try:
        return impl.lower(ctx, group)
    except Unlowerable:
        raise
    except (NotImplementedError, ValueError, KeyError) as e:
        raise Unlowerable(f"group {group.name} [{', '.join(n.op for n in group.nodes)}]: the lowering of {impl.name} "
                          f"refused it ({e}); its accepts() let the fuse pass build it, which is a bug there") from e


def lower_views(ctx: GenContext, group: KernelGroup) -> GroupCode:
    impl = find("torch.view", group.nodes[0].op)
    if impl is None:
        raise Unlowerable(f"no torch.view implementation of {group.nodes[0].op!r}")
    return impl.lower(ctx, group)


def context_for(graph: Graph, plan: Any, descriptor: Any) -> GenContext:
    """Codegen context from the Plan's launch configs and the descriptor's facts."""
    from portlayer.codegen.gemm_rule import (
        gemv_dot_max_tokens,
        gemv_max_tokens,
        gemv_max_weight_bytes,
        triton_gemm_max_tokens,
        wq_vendor_min_tokens,
    )

    launch = {}
    if plan is not None and descriptor.codegen == "triton":
        launch = plan.launch_configs
    return GenContext(graph, launch, warp_size=descriptor.warp_size, compute_units=descriptor.compute_units.count,
                      triton_gemm_max_tokens=triton_gemm_max_tokens(descriptor) if descriptor.codegen == "triton" else 0,
                      gemv_max_tokens=gemv_max_tokens(descriptor) if "gemv" in launch else 0,
                      gemv_dot_max_tokens=gemv_dot_max_tokens(descriptor) if "gemv" in launch else 0,
                      gemv_max_weight_bytes=gemv_max_weight_bytes(descriptor),
                      wq_vendor_min_tokens=wq_vendor_min_tokens(descriptor) if descriptor.codegen == "triton" else 0,
                      shared_memory_bytes=descriptor.compute_units.max_shared_memory_per_block_bytes,
                      kv_dtype=getattr(plan, "kv_cache_dtype", None) if plan is not None else None,
                      kv_block_size=int(_plan_block_size(plan) or 16))


def _plan_block_size(plan: Any) -> int | None:
    try:
        return plan.kv_block_size if plan is not None else None
    except (KeyError, AttributeError):
        return None


def generate(graph: Graph, plan: Any, descriptor: Any, *, fold: bool = True, launch: dict[str, Any] | None = None,
             gemm_max_tokens: int | None = None, gemv_max_tokens: int | None = None,
             gemv_dot_max_tokens: int | None = None) -> GeneratedProgram:
    """The program for a pipeline-optimised ``graph`` on ``descriptor`` (its codegen family's template).

    ``launch`` (family -> config), ``gemm_max_tokens``, ``gemv_max_tokens`` and ``gemv_dot_max_tokens`` override
    the Plan's launch configs and the descriptor's GEMM crossovers: knobs for kernel tests and benchmarks, not
    decisions."""
    ctx = context_for(graph, plan, descriptor)
    if launch:
        ctx.launch = {**ctx.launch, **launch}
    if gemm_max_tokens is not None:
        ctx.triton_gemm_max_tokens = gemm_max_tokens
    if gemv_max_tokens is not None:
        ctx.gemv_max_tokens = gemv_max_tokens
    if gemv_dot_max_tokens is not None:
        ctx.gemv_dot_max_tokens = gemv_dot_max_tokens
    family = descriptor.codegen
    extra = None
    if family == "cann":
        from portlayer.codegen.cann import CannState

        ctx.cann = CannState(graph, plan)  # type: ignore[attr-defined]
        extra = ctx.cann.template_vars  # type: ignore[attr-defined]
    gen = generate_program(graph, ctx, lower_group, lower_views, family=family, target=descriptor.name,
                           extra=extra, fold=fold)
    if family == "cann":
        gen.fallbacks += ctx.cann.fallbacks  # type: ignore[attr-defined]
        gen.calls = list(ctx.cann.calls)  # type: ignore[attr-defined]
    return gen
