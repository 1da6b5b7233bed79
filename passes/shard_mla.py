"""shard, part 3: multi-head latent attention (``mla_attention``, DeepSeek-V2/V3) split by heads.

Each rank keeps num_heads / N query heads: the query projection is column-parallel by heads, the
rows of ``w_kv_b`` that expand the latent into those heads' keys and values follow, the output
projection is row-parallel (``all_reduce`` after it, as for ordinary attention). The latent and
its rotary key are one "head" shared by all query heads, so every rank computes and caches the
same latent entries: the latent cache is replicated, as vLLM does for MLA under TP.

The query reaches the op through data movement (DeepSeek reshapes q to heads, transposes, slices
the rotary half, rotates it against the rope tables and concatenates it back). :func:`trace_heads`
follows the head axis backwards through those ops to the projection, and checks each one keeps
heads apart: reshape (the head-splitting one is rewritten; others may only regroup axes after
the heads), transpose / permute (the axis
moves), slice and concat along another axis, per-head norms and rope, and pointwise ops whose
other operands broadcast along the head axis (size 1 there, like the rope tables). Anything else
returns the reason, and the caller keeps that attention replicated (correct, not divided).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from portlayer.flatten.ir import Node, TensorType
from portlayer.flatten.ops import get_op
from portlayer.passes.shard_rewrite import Rule

HEAD_KEEPING = ("rms_norm", "layer_norm", "cast", "rope", "contiguous", "clone")


@dataclass
class HeadTrace:
    """What splitting one mla_attention by heads rewrites (nothing is changed until it all checks)."""

    projection: Node  # the query projection, column-parallel by heads
    width: int  # its output columns per head
    reshapes: dict[str, int] = field(default_factory=dict)  # reshape node -> the axis of its shape that is heads
    errors: list[str] = field(default_factory=list)


def trace_heads(q: str, heads: int, prod: Mapping[str, Node], types: Mapping[str, TensorType],
                params: Mapping[str, TensorType]) -> HeadTrace | str:
    """Follow the head axis (axis 1 of q [T, H, d]) back to the query projection, or say why not."""
    seen: dict[str, int] = {}
    todo: list[tuple[str, int]] = [(q, 1)]
    reshapes: dict[str, int] = {}
    proj: list[tuple[Node, int]] = []
    shared: list[tuple[str, str]] = []  # (operand, node): the same for every head, if it does not derive from them
    while todo:
        v, axis = todo.pop()
        if v in seen:
            if seen[v] != axis:
                return f"{v} is reached with heads on axes {seen[v]} and {axis}"
            continue
        seen[v] = axis
        node = prod.get(v)
        t = types[v]
        if t.shape[axis] != heads:
            return f"{v} {t} does not hold {heads} heads on axis {axis}"
        if node is None:
            return f"{v} is a graph input or parameter with heads on axis {axis}"
        op = node.op
        if op == "reshape":
            src = types[node.inputs[0]]
            out = list(t.shape)
            shape = node.attrs.get("shape", [])
            if list(src.shape[:axis + 1]) == out[:axis + 1]:  # only axes after the heads are merged or split
                if len(shape) != t.rank or shape[axis] != heads:
                    return f"reshape {node.name} to {shape} does not name the {heads} heads"
                reshapes[node.name] = axis
                todo.append((node.inputs[0], axis))
                continue
            if list(src.shape[:-1]) == out[:axis] and isinstance(src.shape[-1], int) and all(
                    isinstance(d, int) for d in out[axis:]) and math.prod(out[axis:]) == src.shape[-1]:
                if len(shape) != t.rank or shape[axis] != heads:
                    return f"reshape {node.name} to {shape} does not name the {heads} heads"
                reshapes[node.name] = axis  # [.., H*W] -> [.., H, ..]: the head-major split of a projection
                lin = prod.get(node.inputs[0])
                if lin is None or lin.op != "linear" or lin.inputs[1] not in params:
                    return f"the head split {node.name} reads {lin.op if lin else 'an input'}, not a projection"
                proj.append((lin, math.prod(out[axis + 1:])))
                continue
            return f"reshape {node.name} {list(src.shape)} -> {out} moves the head axis"
        if op in ("transpose", "permute"):
            rank = t.rank
            if op == "transpose":
                d0, d1 = int(node.attrs.get("dim0", 0)) % rank, int(node.attrs.get("dim1", 1)) % rank
                perm = list(range(rank))
                perm[d0], perm[d1] = perm[d1], perm[d0]
            else:
                perm = [int(d) % rank for d in node.attrs["dims"]]
            todo.append((node.inputs[0], perm[axis]))
            continue
        if op == "slice":
            if int(node.attrs.get("dim", 0)) % t.rank == axis:
                return f"slice {node.name} cuts the head axis"
            todo.append((node.inputs[0], axis))
            continue
        if op == "concat":
            if int(node.attrs.get("dim", 0)) % t.rank == axis:
                return f"concat {node.name} joins along the head axis"
            todo += [(i, axis) for i in node.inputs if i is not None]
            continue
        if op in HEAD_KEEPING:
            if op.endswith("norm") and axis == t.rank - 1:
                return f"{op} {node.name} normalises across heads"
            todo.append((node.inputs[0], axis))
            shared += [(i, node.name) for i in node.inputs[1:] if i is not None]
            continue
        if get_op(op).kind == "pointwise":
            for i in node.inputs:
                if i is None or i in params and types[i].rank == 0:
                    continue
                it = types[i]
                k = axis - (t.rank - it.rank)  # numpy broadcasting aligns trailing axes
                if k < 0 or it.shape[k] == 1:
                    shared.append((i, node.name))  # broadcast along heads (rope tables, scalars)
                    continue
                if it.shape[k] != t.shape[axis] or it.rank != t.rank:
                    return f"{op} {node.name} mixes a [{', '.join(map(str, it.shape))}] operand into the heads"
                todo.append((i, k))
            continue
        return f"{op} {node.name} on the query path is not known to keep heads apart"
    if len({lin.name for lin, _ in proj}) != 1:
        return f"the query comes from {len({lin.name for lin, _ in proj})} projections, expected one"
    lin, width = proj[0]
    if any(w != width for _, w in proj):
        return "the query's head splits disagree on the head width"
    head_values = set(seen) | {lin.outputs[0].name}
    clean: set[str] = set()
    for operand, user in shared:
        bad = _reaches(operand, head_values, prod, clean)
        if bad:
            return f"{user}'s operand {operand} is computed from the heads ({bad}), e.g. a reduction across them"
    return HeadTrace(lin, width, reshapes)


def _reaches(value: str, targets: set[str], prod: Mapping[str, Node], clean: set[str]) -> str | None:
    """A value of ``targets`` that ``value`` is computed from, else None (``clean`` memoises the misses)."""
    stack, visited = [value], set()
    while stack:
        v = stack.pop()
        if v in clean or v in visited:
            continue
        if v in targets:
            return v
        visited.add(v)
        node = prod.get(v)
        if node is not None:
            stack += [i for i in node.inputs if i is not None]
    clean.update(visited)
    return None


def split_mla(s: Any, att: Node) -> str | None:
    """Split one latent attention by heads for the sharder ``s`` (passes/shard.py); None when done, else
    why it cannot be, with nothing changed (the caller then keeps it whole)."""
    a = att.attrs
    heads, dn, dv = int(a["num_heads"]), int(a["qk_nope_head_dim"]), int(a["v_head_dim"])
    if heads % s.n:
        return f"{heads} heads do not split over {s.n} ranks"
    trace = trace_heads(att.inputs[0], heads, s.prod, s.types, s.g.params)
    if isinstance(trace, str):
        return trace
    if att.inputs[3] not in s.g.params:
        return f"w_kv_b {att.inputs[3]} is computed, not a parameter"
    views, proj = s.output_projection(att)
    if isinstance(proj, str):
        return proj
    per = heads // s.n
    q_heads = list(range(s.rank * per, (s.rank + 1) * per))
    lin, w = trace.projection, trace.width
    rows = [h * w + i for h in q_heads for i in range(w)]
    s.rule(lin.inputs[1], Rule("column", 0, rows))
    if len(lin.inputs) > 2 and lin.inputs[2] is not None:
        s.rule(lin.inputs[2], Rule("column", 0, rows))
    s.done.add(lin.name)
    for name, axis in trace.reshapes.items():
        node = s.g.node(name)
        node.attrs["shape"] = [per if i == axis else d for i, d in enumerate(node.attrs["shape"])]
    s.rule(att.inputs[3], Rule("column", 0, [h * (dn + dv) + i for h in q_heads for i in range(dn + dv)]))
    a["num_heads"] = per
    s.split_output(att, views, proj, heads, q_heads)
    return None

def keep_mla_whole(s: Any, att: Node) -> None:
    """Keep one latent attention whole on every rank: its projections (back to the nearest linears
    on each input, forward to the output projection) are never cut by the MLP or vocabulary rules."""
    stack, seen = [i for i in att.inputs if i is not None], set()
    while stack:
        v = stack.pop()
        node = s.prod.get(v)
        if v in seen or node is None:
            continue
        seen.add(v)
        if get_op(node.op).kind == "gemm":
            s.done.add(node.name)
            continue
        stack += [i for i in node.inputs if i is not None]
    value = att.outputs[0].name
    while len(s.users.get(value, [])) == 1:
        node = s.users[value][0]
        if get_op(node.op).kind == "gemm":
            s.done.add(node.name)
            break
        value = node.outputs[0].name
