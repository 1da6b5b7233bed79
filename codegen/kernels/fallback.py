"""Views and torch-realised ops: host-side aliases, and calls of the op's reference implementation.

Reshapes of contiguous buffers are free views. Other views, and every op that a torch
implementation realises (the whole CPU program, data movement everywhere, an op no generated
kernel takes), call the op's reference semantics from the registry through ``ref``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from portlayer.codegen.kernels.context import GenContext, host_dim
from portlayer.codegen.lowering import GroupCode, KernelGroup
from portlayer.flatten.ir import Node


def view_lines(ctx: GenContext, nodes: Sequence[Node]) -> list[str]:
    lines: list[str] = []
    for n in nodes:
        if n.op == "reshape":
            shape = ", ".join(host_dim(d) for d in n.outputs[0].type.shape)
            lines.append(f"{n.outputs[0].name} = {n.inputs[0]}.reshape({shape})")
        else:
            lines += reference_lines(ctx, [n])
            lines.append(f"{n.outputs[0].name} = {n.outputs[0].name}.contiguous()  # kernels read dense rows")
    return lines


def build_view(ctx: GenContext, group: KernelGroup) -> GroupCode:
    return GroupCode([], view_lines(ctx, group.nodes), [])


def py_literal(x: Any) -> str:
    """Attributes as Python source that evaluates back to them (inf and nan included)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "float('nan')" if math.isnan(x) else ("float('inf')" if x > 0 else "float('-inf')")
    if isinstance(x, dict):
        return "{" + ", ".join(f"{py_literal(k)}: {py_literal(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (list, tuple)):
        body = ", ".join(py_literal(v) for v in x)
        return f"[{body}]" if isinstance(x, list) else f"({body}{',' if len(x) == 1 else ''})"
    return repr(x)


def reference_lines(ctx: GenContext, nodes: Sequence[Node], reason: str = "") -> list[str]:
    lines = [f"# reference op: {reason}"] if reason else []
    for n in nodes:
        ins = ", ".join(i if i is not None else "None" for i in n.inputs)
        outs = ", ".join(v.name for v in n.outputs)
        lines.append(f"{outs}, = ref({n.op!r}, [{ins}], {py_literal(n.attrs)}, st)")
    return lines


def build_reference(ctx: GenContext, group: KernelGroup) -> GroupCode:
    reason = ""
    if group.impl == "reference":
        reason = f"no registered implementation accepts {', '.join(n.op for n in group.nodes)} on this target"
    return GroupCode([], reference_lines(ctx, group.nodes, reason), [])
