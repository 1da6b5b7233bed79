"""The implementation registry: which op is realised by which implementation, under which
capability predicates.

Backends register with :func:`implementation`; the ``select`` pass asks the registry and
never names a device. A predicate returns ``(ok, reason)`` so a refusal is explainable in
``portlayer inspect`` ("cann.npu_mrope: head_size 16 is not a multiple of 32 for float16").

Predicates:
- ``supported(descriptor) -> (bool, str)``: can this device run the implementation at all
  (codegen family, feature flags, dtype throughput)?
- ``supports(node, types) -> (bool, str)``: does this node fit it (shapes, dtypes, attrs)?
- ``match(node, view) -> (list[str] | None, str)``, only for fused vendor ops that realise
  several nodes in one call: the names of the *other* nodes the call absorbs (``None`` =
  the pattern is absent, with the reason).

``traits`` steer fusion and memory planning: ``fusible`` (code can be generated into a
larger kernel), ``epilogue`` (a GEMM that takes pointwise epilogues), ``inplace`` (may
write its output over a dying input of the same size).

Every implementation carries its **lowering**, the decorated function
``lower(ctx, group) -> GroupCode`` that turns one kernel group (codegen/lowering.py) into
code for its family. It is the only place a group becomes code: the fuse pass asks
``accepts(query, nodes)`` before it grows a group whose anchor uses this implementation,
and ``scratch(group)`` names the group-internal values the lowering writes to memory, so
the memory plan gives them arena space. An implementation registered without a lowering
is an error at import time.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from portlayer.capabilities.descriptor import Descriptor
from portlayer.flatten.ir import Graph, Node, TensorType

Verdict = tuple[bool, str]
SupportedFn = Callable[[Descriptor], Verdict]
SupportsFn = Callable[[Node, Mapping[str, TensorType]], Verdict]
MatchFn = Callable[[Node, "GraphView"], tuple["list[str] | None", str]]
LowerFn = Callable[[Any, Any], Any]  # (codegen.lowering.LowerContext, KernelGroup) -> GroupCode
AcceptFn = Callable[[Any, "list[Node]"], Verdict]  # (codegen.lowering.GroupQuery, compute nodes in order)
ScratchFn = Callable[[Any], "list[str]"]  # KernelGroup -> internal values written to memory
FAMILIES = ("torch", "triton", "cann")
_MODULES = ("impls_torch", "impls_triton", "impls_cann", "impls_moe", "impls_cann_moe", "impls_collective")


@dataclass(frozen=True)
class Impl:
    op: str
    name: str
    family: str
    priority: int
    supported: SupportedFn
    supports: SupportsFn
    match: MatchFn | None = None
    traits: Mapping[str, Any] = field(default_factory=dict)
    lower: LowerFn | None = None
    accepts: AcceptFn | None = None
    scratch: ScratchFn | None = None

    @property
    def fused(self) -> bool:
        """A vendor call that realises several portable nodes at once."""
        return self.match is not None

    def trait(self, key: str) -> Any:
        return self.traits.get(key, False)


_REGISTRY: dict[str, list[Impl]] = {}
_PENDING: dict[str, str] = {}  # implementation name -> where it was declared, until its lowering arrives


class RegistryError(RuntimeError):
    """An implementation was declared without a lowering, or twice."""


def _always(*_: Any) -> Verdict:
    return True, ""


def single_node(query: Any, nodes: list[Node]) -> Verdict:
    """The default ``accepts``: the lowering realises exactly one node."""
    return (True, "") if len(nodes) == 1 else (False, f"{nodes[0].op} is realised alone (one node per call)")


def implementation(
    op: str | Iterable[str],
    *,
    name: str,
    family: str,
    priority: int,
    supported: SupportedFn = _always,
    supports: SupportsFn = _always,
    match: MatchFn | None = None,
    accepts: AcceptFn | None = None,
    scratch: ScratchFn | None = None,
    **traits: Any,
) -> Callable[[LowerFn], LowerFn]:
    """Register the decorated lowering ``lower(ctx, group) -> GroupCode`` as implementation
    ``name`` of ``op`` (or of each op). ``accepts`` defaults to one node per group."""
    if family not in FAMILIES:
        raise ValueError(f"implementation {name!r}: family {family!r} is not one of {FAMILIES}")
    ops = [op] if isinstance(op, str) else list(op)
    caller = sys._getframe(1)
    _PENDING[name] = f"{caller.f_code.co_filename}:{caller.f_lineno}"

    def deco(fn: LowerFn) -> LowerFn:
        if not callable(fn):
            raise RegistryError(f"implementation {name!r}: the lowering must be a function, got {fn!r}")
        for o in ops:
            lst = _REGISTRY.setdefault(o, [])
            if any(i.name == name for i in lst):
                raise RegistryError(f"implementation {name!r} of op {o!r} is registered twice (second in {fn.__module__})")
            lst.append(Impl(o, name, family, priority, supported, supports, match, dict(traits), fn,
                            accepts or single_node, scratch))
            lst.sort(key=lambda i: -i.priority)
        _PENDING.pop(name, None)
        return fn

    return deco


def _load() -> None:
    for m in _MODULES:
        importlib.import_module(f"portlayer.backends.{m}")
    if _PENDING:
        raise RegistryError("implementations declared without a lowering (call implementation(...) as a decorator "
                            "on the lowering function): " + ", ".join(f"{n} at {w}" for n, w in sorted(_PENDING.items())))


def all_impls() -> list[Impl]:
    """Every registered implementation (one entry per op it implements)."""
    _load()
    return [i for lst in _REGISTRY.values() for i in lst]


def candidates(op: str) -> list[Impl]:
    """Implementations of ``op`` that select may choose, highest priority first."""
    _load()
    return [i for i in _REGISTRY.get(op, []) if not i.trait("fallback")]


def find(name: str, op: str | None = None) -> Impl | None:
    _load()
    for o, lst in _REGISTRY.items():
        if op is not None and o != op:
            continue
        for i in lst:
            if i.name == name:
                return i
    return None


# ---- graph view for multi-node matchers ---------------------------------------------------------


class GraphView:
    """Read-only producer/user/type queries that vendor matchers need."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.types = graph.value_types()
        self.prod = graph.producers()
        self.users_map = graph.users()

    def producer(self, value: str | None) -> Node | None:
        return self.prod.get(value) if value is not None else None

    def users(self, value: str) -> list[Node]:
        return self.users_map.get(value, [])

    def is_param(self, value: str | None) -> bool:
        return value is not None and value in self.graph.params

    def used_outside(self, value: str, members: set[str]) -> bool:
        """The GroupQuery question a lowering's ``accepts`` asks (codegen/lowering.py)."""
        return value in self.graph.outputs or any(u.name not in members for u in self.users(value))


# ---- descriptor predicates (data, never device names) ---------------------------------------------


def codegen_is(*families: str) -> SupportedFn:
    def f(d: Descriptor) -> Verdict:
        if d.codegen in families:
            return True, ""
        return False, f"descriptor {d.name} generates {d.codegen!r} code, this needs {' or '.join(families)}"

    return f


def needs_feature(feature: str, *, codegen: str | None = None) -> SupportedFn:
    def f(d: Descriptor) -> Verdict:
        if codegen and d.codegen != codegen:
            return False, f"descriptor {d.name} generates {d.codegen!r} code, this is a {codegen} call"
        if not d.has(feature):
            return False, f"descriptor {d.name} does not list feature {feature!r}"
        return True, f"feature {feature!r}: {d.vendor_ops.get(feature, 'listed')}"

    return f


def all_of(*fns: SupportedFn) -> SupportedFn:
    def f(d: Descriptor) -> Verdict:
        for fn in fns:
            ok, why = fn(d)
            if not ok:
                return ok, why
        return True, ""

    return f


def any_feature(*features: str) -> SupportedFn:
    def f(d: Descriptor) -> Verdict:
        have = [x for x in features if d.has(x)]
        if have:
            return True, f"has {have[0]}"
        return False, f"descriptor {d.name} lists none of {list(features)} (no matrix units for a generated GEMM)"

    return f


def out_dtype_in(*dtypes: str) -> SupportsFn:
    def f(node: Node, types: Mapping[str, TensorType]) -> Verdict:
        dt = node.outputs[0].type.dtype
        return (True, "") if dt in dtypes else (False, f"output dtype {dt} is not one of {list(dtypes)}")

    return f


def both(*fns: SupportsFn) -> SupportsFn:
    def f(node: Node, types: Mapping[str, TensorType]) -> Verdict:
        for fn in fns:
            ok, why = fn(node, types)
            if not ok:
                return ok, why
        return True, ""

    return f
