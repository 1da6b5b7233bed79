"""The Flat IR verifier: run between passes so a broken rewrite fails where it happened.

It collects every problem rather than stopping at the first, because a pass bug usually
breaks several nodes at once and the full list points at the cause.
"""

from __future__ import annotations

import keyword
from typing import Any

from portlayer.flatten.ir import Graph, TensorType, dtype_name, torch_dtype
from portlayer.flatten.weights_stream import raw


class VerificationError(ValueError):
    """The graph breaks one or more IR rules; ``problems`` lists each, naming the node."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"graph verification found {len(self.problems)} problem(s):\n{lines}")


def _name_problem(kind: str, name: Any) -> str | None:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        return f"{kind} name {name!r} is not a Python identifier (the printer and parser need one)"
    return None


def _json_problem(v: Any, path: str) -> str | None:
    """Where ``v`` stops being JSON-able (tuples are allowed: they save and print as lists)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return None  # inf/nan included: Python's json writes them as Infinity/NaN
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            p = _json_problem(x, f"{path}[{i}]")
            if p:
                return p
        return None
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                return f"{path} has a non-string key {k!r}"
            p = _json_problem(x, f"{path}[{k!r}]")
            if p:
                return p
        return None
    return f"{path} is a {type(v).__name__}, which is not JSON-able"


def _check_names(graph: Graph, problems: list[str]) -> None:
    seen: dict[str, str] = {}

    def define(name: str, where: str) -> None:
        if name in seen:
            problems.append(f"{where}: value {name!r} is already defined by {seen[name]} (single assignment)")
        else:
            seen[name] = where

    for v in graph.inputs:
        if p := _name_problem("input", v.name):
            problems.append(p)
        define(v.name, f"input {v.name}")
    for name in graph.params:
        if p := _name_problem("param", name):
            problems.append(p)
        define(name, f"param {name}")
    node_names: set[str] = set()
    for n in graph.nodes:
        if p := _name_problem("node", n.name):
            problems.append(p)
        if n.name in node_names:
            problems.append(f"node {n.name}: the node name is used by an earlier node")
        node_names.add(n.name)
        for v in n.outputs:
            if p := _name_problem(f"node {n.name}: output", v.name):
                problems.append(p)
            define(v.name, f"node {n.name}")


def _check_nodes(graph: Graph, problems: list[str]) -> None:
    from portlayer.flatten.ops import all_ops

    registry = all_ops()
    producer = {v.name: n.name for n in graph.nodes for v in n.outputs}
    types: dict[str, TensorType] = {v.name: v.type for v in graph.inputs}
    types.update(graph.params)
    for n in graph.nodes:
        where = f"node {n.name} ({n.op})"
        if not isinstance(n.op, str) or not isinstance(n.inputs, list) or not all(
                i is None or isinstance(i, str) for i in n.inputs) or not isinstance(n.attrs, dict):
            problems.append(f"{where}: op must be a string, inputs a list of value names (or null), attrs an object")
            continue
        for i, name in enumerate(n.inputs):
            if name is None or name in types:
                continue
            if name in producer:
                problems.append(f"{where}: input {i} {name!r} is used before node {producer[name]} defines it")
            else:
                problems.append(f"{where}: input {i} {name!r} is not defined anywhere in the graph")
        for label, d in (("attrs", n.attrs), ("meta", n.meta)):
            if p := _json_problem(d, f"{where}: {label}"):
                problems.append(p)
        opdef = registry.get(n.op)
        if opdef is None:
            problems.append(f"{where}: op {n.op!r} is not in the portable op registry (flatten/op_defs/)")
        else:
            _check_types(n, opdef, types, where, problems)
        for v in n.outputs:
            types[v.name] = v.type


#: what an attribute whose default is None may hold besides None, by attribute name
NULLABLE_ATTRS = {"scalar": "number", "x_scalar": "number", "y_scalar": "number", "min": "number", "max": "number",
                  "scale": "number", "softcap": "number", "sliding_window": "int", "end": "int", "dtype": "dtype"}


def _attr_type_ok(default: Any, v: Any, name: str = "") -> bool:
    """An attribute value has its default's type (ints pass for floats); None defaults per NULLABLE_ATTRS."""
    if default is None:
        kind = NULLABLE_ATTRS.get(name)
        if v is None or kind is None:
            return v is None or isinstance(v, (bool, int, float, str))
        if kind == "dtype":
            try:
                return isinstance(v, str) and bool(torch_dtype(v))
            except (KeyError, ValueError, TypeError):
                return False
        if kind == "int":
            return isinstance(v, int) and not isinstance(v, bool)
        return isinstance(v, (int, float))
    if isinstance(default, bool):
        return isinstance(v, bool)
    if isinstance(default, int):
        return isinstance(v, int) and not isinstance(v, bool)
    if isinstance(default, float):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if isinstance(default, str):
        return isinstance(v, str)
    if isinstance(default, (list, tuple)):
        return isinstance(v, (list, tuple))
    return True


def _check_types(n, opdef, types: dict[str, TensorType], where: str, problems: list[str]) -> None:
    unknown = sorted(set(n.attrs) - set(opdef.attrs))
    if unknown:
        problems.append(f"{where}: unknown attributes {unknown}; {n.op} accepts {sorted(opdef.attrs)}")
        return
    for k, v in n.attrs.items():
        if not _attr_type_ok(opdef.attrs[k], v, k):
            problems.append(f"{where}: attribute {k}={v!r} is a {type(v).__name__}; {n.op} takes a "
                            f"{type(opdef.attrs[k]).__name__} there (default {opdef.attrs[k]!r})")
            return
    if any(i is not None and i not in types for i in n.inputs):
        return  # already reported; inference would only repeat it
    try:
        inferred = opdef.infer([types[i] if i is not None else None for i in n.inputs], opdef.complete_attrs(n.attrs))
    except Exception as e:  # an op's inference may raise anything on bad input types
        problems.append(f"{where}: type inference failed: {type(e).__name__}: {e}")
        return
    declared = [v.type for v in n.outputs]
    if len(inferred) != len(declared):
        problems.append(f"{where}: has {len(declared)} outputs but {n.op} produces {len(inferred)}")
    elif inferred != declared:
        problems.append(
            f"{where}: output types [{', '.join(map(str, declared))}] differ from the registry's "
            f"inference [{', '.join(map(str, inferred))}]"
        )


def _check_outputs_and_weights(graph: Graph, problems: list[str]) -> None:
    defined = {v.name for v in graph.inputs} | set(graph.params) | {v.name for n in graph.nodes for v in n.outputs}
    for o in graph.outputs:
        if o not in defined:
            problems.append(f"graph output {o!r} is not defined by any input, param or node")
    for name, t in graph.params.items():
        if not t.is_static:
            problems.append(f"param {name}: shape {list(t.shape)} is symbolic; weights need static shapes")
    if not graph.weights:
        return
    for name in graph.weights:
        if name not in graph.params:
            problems.append(f"weight {name!r} has no entry in graph.params")
    for name, t in graph.params.items():
        if name not in graph.weights:
            problems.append(f"param {name}: no weight tensor, while other params have one")
            continue
        w = raw(graph.weights, name)  # its dtype and shape: a lazy weight is not made to check them
        try:
            wd = dtype_name(w.dtype)
        except ValueError:
            wd = str(w.dtype)
        if wd != t.dtype or tuple(w.shape) != tuple(t.shape):
            problems.append(f"param {name}: weight is {wd}{list(w.shape)} but the param is declared {t}")


def verify_graph(graph: Graph) -> None:
    """Raise VerificationError listing every broken rule (docs/ir-format.md lists them)."""
    problems: list[str] = []
    _check_names(graph, problems)
    _check_nodes(graph, problems)
    _check_outputs_and_weights(graph, problems)
    if isinstance(graph.meta, dict) and "kernels" in graph.meta:
        from portlayer.flatten.verify_plan import check_kernel_groups

        check_kernel_groups(graph, problems)
    if isinstance(graph.meta, dict) and "memory_plan" in graph.meta:
        from portlayer.flatten.verify_plan import check_memory_plan_shape

        check_memory_plan_shape(graph, problems)
    if problems:
        raise VerificationError(problems)
