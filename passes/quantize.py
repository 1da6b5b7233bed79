"""Weight-only quantization (int8, or int4 with group-wise scales) when the Plan asks for it.

``linear(x, W, b)`` with a parameter ``W`` [N, K] becomes ``linear_wq(x, q, s, b)``:
symmetric round-to-nearest, scale = max|w| / qmax per group of ``group_size`` input
columns (int8: per output channel, group = K; int4: groups of ``options['group_size']``,
default 128, clipped to K). Scales stay float32. The LM head stays in float by default
(``options['quantize_lm_head']``), as vLLM's GPTQ/AWQ loaders do: logits are the most
sensitive output and one GEMM of a large model.
"""

from __future__ import annotations

import torch

from portlayer.flatten.ir import Graph, Node, TensorType
from portlayer.flatten.op_defs.quant import pack_int4
from portlayer.passes.context import PassContext
from portlayer.passes.util import all_names, fresh_name

QMAX = {8: 127, 4: 7}


CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)


def quantize_weight(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, scales) of a [N, K] weight; int4 comes packed two per byte.

    int4 picks, per group, the clipping ratio of max|w| with the least squared error (AWQ's
    and llama.cpp's data-free clip search): 16 levels are too few to spend on rare extremes.
    """
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    amax = wg.abs().amax(-1, keepdim=True)
    best_q, best_s, best_err = None, None, None
    for r in CLIP_RATIOS if bits == 4 else (1.0,):
        s = (amax * r / QMAX[bits]).clamp_min(1e-12)
        q = torch.round(wg / s).clamp(-QMAX[bits] - 1, QMAX[bits])
        err = ((q * s - wg) ** 2).sum(-1, keepdim=True)
        if best_err is None:
            best_q, best_s, best_err = q, s, err
        else:
            better = err < best_err
            best_q, best_s = torch.where(better, q, best_q), torch.where(better, s, best_s)
            best_err = torch.minimum(err, best_err)
    q = best_q.to(torch.int8).reshape(n, k)
    return (pack_int4(q) if bits == 4 else q), best_s[..., 0]


def pick_group(k: int, bits: int, requested: int) -> int:
    """int8 is per channel; int4 uses ``requested`` columns per group, min(requested, K),
    falling back to per channel when K is not a multiple of it."""
    if bits == 8:
        return k
    g = min(requested, k)
    return g if k % g == 0 else k


def quantize(graph: Graph, ctx: PassContext) -> Graph:
    mode = ctx.options.get("weight_quantization") or ctx.plan.weight_quantization
    if mode in (None, "none"):
        return graph.copy()
    if mode not in ("int8", "int4"):
        raise ValueError(f"quantize: the plan asks for {mode!r}; this pass knows int8 and int4")
    bits = 8 if mode == "int8" else 4
    g = graph.copy()
    names = all_names(g)
    skip_head = not ctx.options.get("quantize_lm_head", False)
    out_producers = set(g.outputs)
    for i, n in enumerate(g.nodes):
        if n.op != "linear" or n.inputs[1] not in g.weights:
            continue
        if skip_head and n.outputs[0].name in out_producers:
            continue
        w = g.weights[n.inputs[1]]
        k = int(w.shape[1])
        if bits == 4 and k % 2:
            continue
        gs = pick_group(k, bits, int(ctx.options.get("group_size", 128)))
        q, s = quantize_weight(w, bits, gs)
        qn, sn = fresh_name(names, f"{n.inputs[1]}_q{bits}"), fresh_name(names, f"{n.inputs[1]}_scales")
        for name, t in ((qn, q), (sn, s)):
            g.params[name] = TensorType(str(t.dtype).replace("torch.", ""), tuple(t.shape))
            g.weights[name] = t
        bias = n.inputs[2] if len(n.inputs) > 2 else None
        g.nodes[i] = Node(n.name, "linear_wq", [n.inputs[0], qn, sn, bias], n.outputs, {"bits": bits, "group_size": gs},
                          dict(n.meta, quantized=f"{mode} weight-only, group {gs}"))
    from portlayer.passes.dce import dce

    return dce(g)
