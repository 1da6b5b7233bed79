"""What every kernel builder sees: the graph, value types, launch configs and device facts."""

from __future__ import annotations

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
    types: dict[str, TensorType] = field(init=False)
    nodes: dict[str, Node] = field(init=False)

    def __post_init__(self) -> None:
        self.types = self.graph.value_types()
        self.nodes = {n.name: n for n in self.graph.nodes}

    def cfg(self, family: str) -> dict[str, int]:
        cfg = dict(self.launch.get(family) or {})
        return cfg or dict(DEFAULT_LAUNCH[family])

    def row_warps(self, family: str, block_n: int, dtype: str) -> int:
        """Warps for a row of ``block_n`` elements: one 16-byte vector per thread, at most the Plan's."""
        vec = max(1, 16 // dtype_itemsize(dtype))
        want = pow2(max(1, block_n // vec)) // self.warp_size
        return max(1, min(self.cfg(family)["num_warps"], want))


#: Used when the Plan has no Triton launch config (e.g. a CPU plan rendered for tests).
DEFAULT_LAUNCH: dict[str, dict[str, int]] = {
    "pointwise": {"num_warps": 4, "BLOCK": 1024, "num_stages": 1},
    "reduction": {"num_warps": 4, "BLOCK_N": 1024, "num_stages": 1},
    "embedding": {"num_warps": 4, "BLOCK_N": 1024, "num_stages": 1},
    "rope": {"num_warps": 4, "BLOCK_H": 16, "BLOCK_D": 64, "num_stages": 1},
    "reshape_and_cache": {"num_warps": 4, "BLOCK": 1024, "num_stages": 1},
    "gemm": {"num_warps": 8, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 3},
    "attention_decode": {"num_warps": 4, "BLOCK_H": 16, "BLOCK_N": 16, "BLOCK_D": 128, "num_stages": 2},
    "attention_prefill": {"num_warps": 8, "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": 128, "num_stages": 2},
}


@dataclass
class GroupCode:
    """A group's realisation: kernels to define, host statements, values needing planned buffers."""

    kernels: list[KernelSpec] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)


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


def make_kernel(template: str, family: str, variant: str, params: list[Param], constexprs: dict[str, Any],
                num_warps: int, num_stages: int = 1, **ctx: Any) -> KernelSpec:
    """Render ``template``; the kernel's name carries a digest of its source so equal kernels dedupe."""
    probe = render(template, fn="KERNEL", **ctx)
    import hashlib

    digest = hashlib.sha256(probe.encode()).hexdigest()[:6]
    fn = f"{family}_{variant}_{digest}"
    source = render(template, fn=fn, **ctx)
    return KernelSpec(name=fn, family=family, source=source, fn=fn, params=params, constexprs=constexprs,
                      num_warps=num_warps, num_stages=num_stages, doc=ctx.get("doc", ""))
