"""What every kernel builder sees: the graph, value types, launch configs and device facts."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

import sympy

from portlayer.codegen.render import render
from portlayer.codegen.spec import TL_DTYPE, KernelSpec, Param, pow2
from portlayer.flatten.ir import Graph, Node, TensorType, dtype_itemsize

#: IR symbols -> names of host-program locals.
HOST_SYMBOLS = {"num_tokens": "T", "num_seqs": "S"}


@dataclass
class GenContext:
    """Per-program codegen state. ``launch`` holds the Plan's launch config per family."""

    graph: Graph
    launch: dict[str, dict[str, int]]
    warp_size: int = 32
    compute_units: int = 108
    triton_gemm_max_tokens: int = 0
    gemv_max_tokens: int = 0
    gemv_dot_max_tokens: int = 0  # the few-rows kernels' tensor-core tier up to these rows (gemm_rule; 0: none)
    gemv_max_weight_bytes: int = 0
    wq_vendor_min_tokens: int = 0  # linear_wq: dequantize + vendor GEMM from these rows (0: never; gemm_rule)
    shared_memory_bytes: int = 48 * 1024  # per block, from the descriptor (tile choices of MoE kernels)
    kv_dtype: str | None = None  # the Plan's kv_cache_dtype (None: the attention's own K/V dtype)
    kv_block_size: int = 16  # the Plan's kv_block_size: the page size the attention binaries are compiled for
    types: dict[str, TensorType] = field(init=False)
    nodes: dict[str, Node] = field(init=False)

    def __post_init__(self) -> None:
        self.types = self.graph.value_types()
        self.nodes = {n.name: n for n in self.graph.nodes}

    def cfg(self, family: str) -> dict[str, int]:
        """The Plan's launch config for ``family`` (capabilities/policy.py is the one table)."""
        cfg = dict(self.launch.get(family) or {})
        if not cfg:
            raise KeyError(f"the Plan has no launch config for kernel family {family!r}: it was negotiated for a "
                           "target that does not generate Triton code; compile for a Triton target")
        return cfg

    def cache_dtype(self, kv_dtype: str) -> str:
        """The paged KV cache's element type for attention K/V of ``kv_dtype``: the Plan's kv_cache_dtype."""
        return self.kv_dtype or kv_dtype

    def kv_cache_expr(self, layer: int) -> str:
        """How host code names one layer's (k_cache, v_cache) pair; layer loops rename it."""
        return f"kv_caches[{layer}]"

    def row_warps(self, family: str, block_n: int, dtype: str) -> int:
        """Warps for a row of ``block_n`` elements: one 16-byte vector per thread, at most the Plan's."""
        vec = max(1, 16 // dtype_itemsize(dtype))
        want = pow2(max(1, block_n // vec)) // self.warp_size
        return max(1, min(self.cfg(family)["num_warps"], want))


def host_dim(d: Any) -> str:
    """A shape dim as a host-program expression (num_tokens -> T)."""
    if isinstance(d, int):
        return str(d)
    from portlayer.flatten.ir import to_sympy

    expr = to_sympy(d)  # the strict dim grammar (flatten/dims.py): no sympify on IR text
    return str(expr.xreplace({s: sympy.Symbol(HOST_SYMBOLS.get(s.name, s.name)) for s in expr.free_symbols}))


def host_numel(shape: Any) -> str:
    parts = [host_dim(d) for d in shape]
    ints = 1
    syms = []
    for p in parts:
        if p.isdigit():
            ints *= int(p)
        else:
            syms.append(p if p.isidentifier() else f"({p})")
    return " * ".join(syms + ([str(ints)] if ints != 1 or not syms else []))


def round_dtype(dtype: str) -> str | None:
    """The tl dtype to round through where the reference rounds, or None for float32."""
    return TL_DTYPE[dtype] if dtype in ("float16", "bfloat16") else None


def dot_args(dtype: str) -> str:
    """float32 dots use IEEE precision: Triton would otherwise use TF32 on tensor cores."""
    return ', input_precision="ieee"' if dtype == "float32" else ""


def code_digest(source: str) -> str:
    """Identity of a kernel: its code without the module docstring and comments, so kernels that
    differ only in what their prose says share one module."""
    body = re.sub(r'^\s*"""[\s\S]*?"""', "", source, count=1)
    lines = [re.sub(r"\s+#.*$", "", ln).rstrip() for ln in body.splitlines() if not ln.strip().startswith("#")]
    return hashlib.sha256("\n".join(ln for ln in lines if ln).encode()).hexdigest()[:6]


def make_kernel(template: str, family: str, variant: str, params: list[Param], constexprs: dict[str, Any],
                num_warps: int, num_stages: int = 1, **ctx: Any) -> KernelSpec:
    """Render ``template``; the kernel's name carries a digest of its code so equal kernels dedupe."""
    digest = code_digest(render(template, fn="KERNEL", **ctx))
    fn = f"{family}_{variant}_{digest}"
    source = render(template, fn=fn, **ctx)
    return KernelSpec(name=fn, family=family, source=source, fn=fn, params=params, constexprs=constexprs,
                      num_warps=num_warps, num_stages=num_stages, doc=ctx.get("doc", ""))
