"""KernelSpec: one rendered Triton kernel plus what is needed to compile and launch it.

The host program launches kernels by name with the arguments of ``params``; the AOT
tier compiles them from ``signature()`` and ``constexprs`` without a GPU.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any

#: Flat IR dtype -> Triton pointer element / tl dtype spelling.
TRITON_DTYPE = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int64": "i64", "int32": "i32",
    "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1", "float8_e4m3fn": "fp8e4nv",
}  # fmt: skip
TL_DTYPE = {
    "float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16", "int64": "tl.int64",
    "int32": "tl.int32", "int16": "tl.int16", "int8": "tl.int8", "uint8": "tl.uint8", "bool": "tl.int1",
}  # fmt: skip
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Param:
    """A kernel argument: ``kind`` is a Triton signature type ('*bf16', 'i32', 'fp32') or 'constexpr'."""

    name: str
    kind: str


@dataclass
class KernelSpec:
    """A rendered kernel; ``fn`` names the @triton.jit function inside ``source``."""

    name: str
    family: str
    source: str
    fn: str
    params: list[Param]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 1
    doc: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    #: other launch configurations of this same source (one kernel module, several compiled binaries):
    #: a kernel shared by groups of different shapes is specialised per constexpr set, as Triton's JIT does
    variants: list[KernelSpec] = field(default_factory=list)
    #: constexpr values the host program picks per step (the row tile by the step's rows): each dict
    #: overrides ``constexprs`` for one launch configuration that the shipped binaries must cover
    runtime_choices: list[dict[str, Any]] = field(default_factory=list)

    def signature(self) -> dict[str, str]:
        """Argument name -> Triton type, in order; every Triton template's last parameter is ``PDL``
        (templates/triton/_pdl.j2: False unless codegen/aot.py compiles a binary for programmatic dependent launch)."""
        return {**{p.name: p.kind for p in self.params}, "PDL": "constexpr"}

    def launch_key(self) -> str:
        """What makes a compiled binary of this source distinct: argument types, constexprs, warps, stages."""
        return json.dumps([self.signature(), self.constexprs, self.num_warps, self.num_stages, self.runtime_choices],
                          sort_keys=True, default=str)

    def add_variant(self, other: KernelSpec) -> None:
        """Record ``other`` (same name, so the same code: make_kernel names kernels by their code's digest) as
        a variant of this kernel when it launches with another configuration."""
        key = other.launch_key()
        if key != self.launch_key() and all(v.launch_key() != key for v in self.variants):
            self.variants.append(other)

    def launches(self) -> list[KernelSpec]:
        """Every launch configuration of this kernel (one binary each): per variant, each run-time choice."""
        out: list[KernelSpec] = []
        seen: set[str] = set()
        for spec in (self, *self.variants):
            for choice in spec.runtime_choices or [{}]:
                one = replace(spec, constexprs={**spec.constexprs, **choice}, variants=[], runtime_choices=[])
                if one.launch_key() not in seen:
                    seen.add(one.launch_key())
                    out.append(one)
        return out

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:8]


def ptr(dtype: str) -> str:
    return "*" + TRITON_DTYPE[dtype]


def pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def short_dtype(dtype: str) -> str:
    return TRITON_DTYPE.get(dtype, dtype)
