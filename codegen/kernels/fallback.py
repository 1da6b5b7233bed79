"""Views and ops without a Triton template: realised with torch (views) or the reference op.

Reshapes of contiguous buffers are free views. Anything else calls the op's reference
implementation from the registry, so a graph with an unusual op still runs (slower), and
the host program says so in a comment.
"""

from __future__ import annotations

from typing import Any

from portlayer.codegen.kernels.context import GenContext, GroupCode, host_dim


def build_view(ctx: GenContext, group: dict[str, Any]) -> GroupCode:
    lines: list[str] = []
    for name in group["nodes"]:
        n = ctx.nodes[name]
        if n.op == "reshape":
            shape = ", ".join(host_dim(d) for d in n.outputs[0].type.shape)
            lines.append(f"{n.outputs[0].name} = {n.inputs[0]}.reshape({shape})")
        else:
            lines += build_reference(ctx, {"nodes": [name]}).lines
            lines.append(f"{n.outputs[0].name} = {n.outputs[0].name}.contiguous()  # kernels read dense rows")
    return GroupCode([], lines, [])


def build_reference(ctx: GenContext, group: dict[str, Any], reason: str = "") -> GroupCode:
    lines = [f"# reference op (no Triton template{': ' + reason if reason else ''})"] if reason else []
    for name in group["nodes"]:
        n = ctx.nodes[name]
        ins = ", ".join(i if i is not None else "None" for i in n.inputs)
        outs = ", ".join(v.name for v in n.outputs)
        lines.append(f"{outs}, = ref({n.op!r}, [{ins}], {attrs_literal(n.attrs)}, st)")
    return GroupCode([], lines, [])


def attrs_literal(attrs: dict[str, Any]) -> str:
    """repr() of the attrs, with non-finite floats (masked_fill(-inf) in MoE routers) spelled
    so that the generated program parses: repr(-inf) is a bare name."""
    text = repr(attrs)
    for bad, good in (("-inf", "float('-inf')"), ("inf", "float('inf')"), ("nan", "float('nan')")):
        text = text.replace(f": {bad},", f": {good},").replace(f": {bad}}}", f": {good}}}")
    return text
