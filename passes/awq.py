"""Activation-aware weight scaling (AWQ, Lin et al., 2023), folded so the kernels stay the same.

A linear's input channels with large activations matter more than the rest, yet a group's
quantization grid treats all its columns alike. AWQ multiplies column ``j`` of the weight by
``s_j`` (so the salient columns get finer steps relative to their size) and divides the
activation by ``s_j`` where it is made, which leaves the float function unchanged:

- the input comes from an ``rms_norm`` / ``layer_norm`` read only by these linears: its weight
  ``gamma`` becomes ``(gamma + offset) / s - offset`` (``offset``: Gemma's ``1 + gamma`` form);
- the input is ``mul(a, b)`` read only by this linear, with ``b`` (or ``a``) a linear read only by
  that mul (SwiGLU's up_proj): that linear's rows (and bias) are divided by ``s`` (already
  quantized, as in the true-sequential mode: its rows' scales and offsets).

Anywhere else (o_proj after GQA attention, for instance) the linear is not scaled. ``s`` is
``rms(x)^alpha`` (normalized), ``alpha`` searched on a grid for the least output error
``tr(dW H dW^T)`` of the quantized weight, with H = X^T X from the calibration run; alpha = 0 is
plain round-to-nearest, so the search never picks a scaling worse than none on that proxy
(graded on at most SEARCH_ROWS rows of the weight, to keep compile time down).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from portlayer.flatten.ir import Graph

ALPHAS = tuple(i / 10 for i in range(10))
SEARCH_ROWS = 512  # rows of the weight the search grades (every n-th): quantization is per row, so exact for those
NORMS = ("rms_norm", "layer_norm")


def search_scale(w: torch.Tensor, gram: torch.Tensor, rows: int, bits: int, group_size: int,
                 symmetric: bool, clip_output: bool = False) -> tuple[torch.Tensor, float]:
    """(s [K] float32, alpha) minimising the calibration output error of ``w`` [N, K] quantized
    (``clip_output``: each candidate's clip search grades the output error too)."""
    from portlayer.passes.gptq import gram_blocks, rtn

    w = w.float()[:: max(1, w.shape[0] // SEARCH_ROWS)]
    h = (gram / max(rows, 1)).float()
    mag = torch.diag(h).clamp_min(0).sqrt().clamp_min(1e-8)
    best: tuple[float, torch.Tensor, float] | None = None
    for a in ALPHAS:
        s = mag ** a
        s = s / (s.max() * s.min()).sqrt()
        hb = gram_blocks(h.double() / s.double()[:, None] / s.double()[None, :], 1, group_size) if clip_output else None
        q, sc, off = rtn(w * s, bits, group_size, symmetric, hb)
        n, k = w.shape
        dq = q.float().reshape(n, k // group_size, group_size) * sc[:, :, None]
        if off is not None:
            dq = dq + off[:, :, None]
        dw = w - dq.reshape(n, k) / s
        err = float(((dw @ h) * dw).sum())
        if best is None or err < best[0]:
            best = (err, s, a)
    assert best is not None
    return best[1], best[2]


def _consumers(g: Graph) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, n in enumerate(g.nodes):
        for x in n.inputs:
            if x is not None:
                out.setdefault(x, []).append(i)
    return out


def fold_target(g: Graph, idx: Sequence[int]) -> tuple[str, int] | None:
    """Where the activation of linears ``idx`` (all reading one input) can absorb ``1/s``:
    ("norm", norm node index) or ("rows", producer linear index); None when nowhere exact."""
    x = g.nodes[idx[0]].inputs[0]
    cons = _consumers(g)
    if sorted(cons.get(x, [])) != sorted(idx) or x in g.outputs:
        return None
    prod = {o.name: i for i, n in enumerate(g.nodes) for o in n.outputs}
    p = prod.get(x)
    if p is None:
        return None
    pn = g.nodes[p]
    if pn.op in NORMS and len(pn.inputs) > 1 and pn.inputs[1] in g.weights and len(cons.get(pn.inputs[1], [])) == 1:
        return ("norm", p)
    if pn.op == "mul" and len(pn.inputs) == 2 and not pn.attrs.get("scalar"):
        for operand in pn.inputs:
            q = prod.get(operand)
            if q is None or operand in g.outputs or cons.get(operand) != [p]:
                continue
            qn = g.nodes[q]
            if qn.op in ("linear", "linear_wq") and all(
                    x is None or (x in g.weights and len(cons.get(x, [])) == 1) for x in qn.inputs[1:]):
                return ("rows", q)
    return None


def apply_scale(g: Graph, idx: Sequence[int], where: tuple[str, int], s: torch.Tensor) -> None:
    """Multiply the weights of linears ``idx`` by ``s`` per column and divide their input by ``s``
    at ``where`` (new tensors in ``g.weights``, dtypes kept)."""
    for i in idx:
        name = g.nodes[i].inputs[1]
        w = g.weights[name]
        g.weights[name] = (w.float() * s[None, :]).to(w.dtype)
    kind, p = where
    node = g.nodes[p]
    if kind == "norm":
        name, off = node.inputs[1], float(node.attrs.get("weight_offset") or 0.0)
        gamma = g.weights[name]
        g.weights[name] = ((gamma.float() + off) / s - off).to(gamma.dtype)
        if len(node.inputs) > 2 and node.inputs[2] in g.weights:  # layer_norm's beta
            beta = g.weights[node.inputs[2]]
            g.weights[node.inputs[2]] = (beta.float() / s).to(beta.dtype)
    else:  # a quantized producer (true-sequential: up_proj before down_proj) scales its rows'
        # scales and offsets, exactly: (q * scale + offset) / s = q * (scale / s) + offset / s
        wq = node.op == "linear_wq"
        rows = [node.inputs[2], *node.inputs[4:5]] if wq else [node.inputs[1]]
        bias = node.inputs[3:4] if wq else node.inputs[2:3]
        for name in [x for x in rows + bias if x is not None]:
            w = g.weights[name]
            g.weights[name] = (w.float() / (s[:, None] if w.dim() == 2 else s)).to(w.dtype)
