"""True-sequential calibration: quantize each group of linears on the inputs the already
quantized layers before it produce (GPTQ's sequential mode).

One float32 run of the graph on the packed calibration sequences, node by node; when the run
reaches the first linear of a group (the linears reading one activation: q/k/v, gate/up, o,
down), ``on_group`` sees that activation, quantizes the group in place in the graph (the node
becomes ``linear_wq``, so every later node computes on quantized outputs) and may hand back
the activation rescaled (AWQ divides it by its per-channel scales). Why: a layer calibrated
on the float model's activations fits an input distribution the quantized model never sees;
the error of the earlier layers is part of what the later ones should absorb.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from portlayer.flatten.ir import Graph
from portlayer.flatten.op_defs.attention import AttentionMetadata
from portlayer.flatten.ops import get_op

OnGroup = Callable[[list[int], torch.Tensor], "torch.Tensor | None"]


def run_sequential(graph: Graph, seqs: Sequence[torch.Tensor], groups: Sequence[list[int]], on_group: OnGroup,
                   device: torch.device | str = "cpu") -> None:
    """Run ``graph`` on ``seqs`` (token id tensors, one sequence each) and call ``on_group(idx, x)``
    with the [tokens, K] input of each group ``idx`` (node indices reading one value) before the
    group runs, on ``device``. Stops after the last group's nodes (the LM head is not run)."""
    from portlayer.flatten.interpret import ExecContext, bind_symbols

    names = {v.name for v in graph.inputs}
    if not {"input_ids", "positions"} <= names:
        raise ValueError(f"calibration runs token-stream graphs; this one takes {sorted(names)}")
    ids = torch.cat([s.long() for s in seqs]).to(device)
    feeds = {"input_ids": ids, "positions": torch.cat([torch.arange(int(s.shape[0])) for s in seqs]).to(device)}
    feeds.update({v.name: torch.arange(ids.shape[0], device=device) for v in graph.inputs if v.name == "logits_indices"})
    ctx = ExecContext(attn_metadata=AttentionMetadata.from_lens([int(s.shape[0]) for s in seqs], device=device),
                      device=device)
    ctx.bindings = bind_symbols(graph, {k: v for k, v in feeds.items() if k in names})
    ctx.bindings.setdefault("num_seqs", len(seqs))
    first = {min(idx): list(idx) for idx in groups}
    stop = max((max(idx) for idx in groups), default=-1)
    env: dict[str, torch.Tensor] = dict(feeds)
    last: dict[str, int] = {x: i for i, n in enumerate(graph.nodes) for x in n.inputs if x is not None}
    with torch.no_grad():
        for i in range(stop + 1):
            if i in first:
                src = graph.nodes[i].inputs[0]
                x = env[src]
                new = on_group(first[i], x.reshape(-1, x.shape[-1]).float())
                if new is not None:
                    env[src] = new.reshape(x.shape).to(x.dtype)
            n = graph.nodes[i]  # read after on_group: it may have become linear_wq
            args = [None if x is None else env[x] if x in env else _param(graph, x, device) for x in n.inputs]
            for v, t in zip(n.outputs, get_op(n.op).reference(args, n.attrs, ctx)):
                env[v.name] = t
            for x in n.inputs:
                if x is not None and last.get(x) == i:
                    env.pop(x, None)


def _param(graph: Graph, name: str, device: torch.device | str) -> torch.Tensor:
    w = graph.weights[name].to(device)
    return w.float() if w.is_floating_point() else w
