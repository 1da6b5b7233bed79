"""Reference execution: run a Flat IR graph node by node with each op's torch semantics."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from portlayer.flatten.ir import Graph, dim_symbols, torch_dtype
from portlayer.flatten.op_defs.attention import AttentionMetadata
from portlayer.flatten.ops import get_op


@dataclass
class ExecContext:
    """What ops that need more than their inputs see: symbol bindings, attention metadata,
    the paged KV cache (one (k, v) pair per attention layer) and the device."""

    bindings: dict[str, int] = field(default_factory=dict)
    attn_metadata: AttentionMetadata | None = None
    kv_cache: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
    device: torch.device | str = "cpu"


def bind_symbols(graph: Graph, inputs: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Bind symbolic dims (e.g. num_tokens) from the concrete input shapes."""
    bindings: dict[str, int] = {}
    for v in graph.inputs:
        t = inputs[v.name]
        if len(t.shape) != v.type.rank:
            raise ValueError(f"input {v.name!r}: expected rank {v.type.rank} ({v.type}), got shape {tuple(t.shape)}")
        for d, n in zip(v.type.shape, t.shape):
            if isinstance(d, int):
                if d != n:
                    raise ValueError(f"input {v.name!r}: expected {v.type}, got shape {tuple(t.shape)}")
            elif dim_symbols(d) == {d}:
                if bindings.setdefault(d, int(n)) != int(n):
                    raise ValueError(f"symbol {d!r} bound to {bindings[d]} and {n} by different inputs")
    return bindings


def bound_context(graph: Graph, inputs: Mapping[str, torch.Tensor], ctx: ExecContext) -> ExecContext:
    """``ctx`` ready to run ``graph`` on ``inputs``: every input given, the symbols bound from their shapes."""
    missing = [v.name for v in graph.inputs if v.name not in inputs]
    if missing:
        raise ValueError(f"missing graph inputs {missing}; the graph takes {[v.name for v in graph.inputs]}")
    if not ctx.bindings:
        ctx.bindings = bind_symbols(graph, inputs)
    ctx.bindings.setdefault("num_seqs", 1 if ctx.attn_metadata is None else len(ctx.attn_metadata.seq_lens))
    return ctx


def last_uses(graph: Graph) -> dict[str, int]:
    """Index of the last node reading each value: the interpreters free a value after it."""
    last: dict[str, int] = {}
    for i, n in enumerate(graph.nodes):
        for x in n.inputs:
            if x is not None:
                last[x] = i
    return last


def run_node(n: Any, args: list[Any], ctx: Any) -> Sequence[torch.Tensor]:
    """One node's reference op on its arguments; a failure names the node, its op and where it came from."""
    try:
        return get_op(n.op).reference(args, n.attrs, ctx)
    except Exception as e:
        src = n.meta.get("source", "?")
        raise RuntimeError(f"node {n.name} ({n.op}, from {src}) failed: {type(e).__name__}: {e}") from e


def run_graph(
    graph: Graph,
    inputs: Mapping[str, torch.Tensor],
    ctx: ExecContext | None = None,
    *,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Execute ``graph`` on named inputs; returns the graph outputs in order."""
    ctx = bound_context(graph, inputs, ctx or ExecContext())
    params = weights if weights is not None else graph.weights  # read per node: a lazy weight lives one op
    env: dict[str, torch.Tensor] = {v.name: inputs[v.name] for v in graph.inputs}
    last_use = last_uses(graph)
    keep = set(graph.outputs) | set(graph.params)
    for i, n in enumerate(graph.nodes):
        args = [(env[x] if x in env else params[x]) if x is not None else None for x in n.inputs]
        outs = run_node(n, args, ctx)
        for v, t in zip(n.outputs, outs):
            env[v.name] = t
        for x in n.inputs:
            if x is not None and last_use.get(x) == i and x not in keep:
                env.pop(x, None)
    return [env[o] if o in env else params[o] for o in graph.outputs]


def interpret(
    graph: Graph,
    input_ids: torch.Tensor | Sequence[int],
    positions: torch.Tensor | None = None,
    *,
    attn_metadata: AttentionMetadata | None = None,
    ctx: ExecContext | None = None,
) -> torch.Tensor:
    """Run a captured model on a token stream; returns its single output.

    By default the stream is one sequence at positions 0..T-1. Pass ``attn_metadata`` (and
    matching ``positions``) to pack several sequences into one stream.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be a flat [num_tokens] stream, got shape {tuple(ids.shape)}")
    if positions is None:
        if attn_metadata is not None:
            starts = attn_metadata.query_start_loc.tolist()
            positions = torch.cat([torch.arange(e - s) for s, e in zip(starts[:-1], starts[1:])])
        else:
            positions = torch.arange(ids.shape[0])
    ctx = ctx or ExecContext()
    if attn_metadata is not None:
        ctx.attn_metadata = attn_metadata
    feeds: dict[str, torch.Tensor] = {}
    for v in graph.inputs:
        if v.name == "input_ids":
            feeds[v.name] = ids.to(torch_dtype(v.type.dtype))
        elif v.name == "positions":
            feeds[v.name] = torch.as_tensor(positions).to(torch_dtype(v.type.dtype))
        else:
            raise ValueError(f"graph input {v.name!r} has no default; call run_graph() with it")
    outs = run_graph(graph, feeds, ctx)
    return outs[0] if len(outs) == 1 else outs  # type: ignore[return-value]
