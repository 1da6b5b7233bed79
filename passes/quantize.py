"""Weight-only quantization when the Plan asks for it: ``linear(x, W, b)`` -> ``linear_wq``.

Modes (``plan.weight_quantization``, or ``options['weight_quantization']``):

- ``int8``: groups of 32 input columns (``INT8_GROUP``; ``options['group_size']`` overrides it,
  K = per output channel), asymmetric (scale + offset), round-to-nearest with the clip search
  (passes/gptq.py). Why groups: one scale per 576-1536-wide row is set by the row's largest
  weights, which costs the rest their resolution; on SmolLM2 per channel measured 96.7% top-1
  and group 32 asymmetric 100% (docs/quantization.md says why), and every shipped int8 kernel
  takes group 32.
- ``int4``: groups of ``options['group_size']`` (default: the plan's ``quant_group_size``,
  else 128), asymmetric (scale + offset per group), calibrated round-to-nearest (``clip``): each
  group's min/max shrink and a least-squares scale/offset refit chosen by the layer's output error
  on the built-in text passes/calib_text.txt (through the model's own tokenizer), true-sequential
  (passes/sequential.py: each layer on the activations of the already-quantized ones).
- ``native``: the linear weights a GGUF source shipped in block form (Q8_0/Q4_0/Q4_1 at group
  32, flatten/gguf_blocks.py) are used as they are; every other weight stays float.

``options['quant_method']`` (``rtn``, ``clip``, ``gptq``, ``awq``, ``awq+gptq``) overrides the method,
``options['act_order']`` / ``options['gptq_damp']`` tune GPTQ, ``options['symmetric']`` the offsets,
``options['sequential']`` / ``options['clip']`` / ``options['calibration_tokens']`` /
``options['calibration_device']`` the calibration (docs/quantization.md).
The LM head stays in float unless ``options['quantize_lm_head']``, as vLLM's GPTQ/AWQ loaders
do: logits are the most sensitive output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from portlayer.flatten.ir import Graph, Node, TensorType, torch_dtype
from portlayer.flatten.op_defs.quant import pack_int4
from portlayer.passes.context import PassContext
from portlayer.passes.util import all_names, fresh_name

MODES = ("int8", "int4", "native")
INT8_GROUP = 32  # the smallest group every linear_wq lowering takes (Triton: 16, CANN: 32)
DEFAULT_METHOD = {8: "rtn", 4: "clip"}  # the best measured on SmolLM2 (docs/quantization.md)


def pick_group(k: int, bits: int, requested: int | None) -> int:
    """Columns per group: ``requested`` (default: int8 INT8_GROUP, int4 128), clipped
    to K. linear_wq needs K % group == 0, so when K is not a multiple (SmolLM2's K = 576 at 128)
    the group halves down to 32 (576 -> 64); per channel only when no such group divides K."""
    if requested is None:
        requested = INT8_GROUP if bits == 8 else 128
    g = min(int(requested), k)
    while k % g and g > 32 and g % 2 == 0:
        g //= 2
    return g if k % g == 0 else k


def quantize_weight(w: torch.Tensor, bits: int, group_size: int, gram: tuple[torch.Tensor, int] | None = None,
                    symmetric: bool | None = None, act_order: bool = False, damp: float = 0.01,
                    clip_gram: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(qweight, scales, offsets or None) of a [N, K] weight; int4 comes packed two per byte.

    With ``gram`` (X^T X of the layer's inputs, rows) the codes come from GPTQ, else from
    round-to-nearest (GPTQ with an identity Hessian is exactly that), whose clip search grades
    the output error on ``clip_gram``'s inputs when given, else the weight error.
    """
    from portlayer.passes.gptq import gptq, gram_blocks, rtn

    sym = False if symmetric is None else symmetric
    if gram is not None:
        q, s, off = gptq(w, gram[0], gram[1], bits, group_size, sym, damp=damp, act_order=act_order,
                         clip_output=clip_gram is not None)
    else:
        h = gram_blocks(clip_gram[0], clip_gram[1], group_size) if clip_gram is not None else None
        q, s, off = rtn(w, bits, group_size, sym, h)
    return (pack_int4(q) if bits == 4 else q), s, off


def _targets(g: Graph, ctx: PassContext) -> list[int]:
    skip_head = not ctx.options.get("quantize_lm_head", False)
    outs = set(g.outputs)
    return [i for i, n in enumerate(g.nodes)
            if n.op == "linear" and n.inputs[1] in g.weights and not (skip_head and n.outputs[0].name in outs)]


def _replace(g: Graph, names: set[str], i: int, q: torch.Tensor, s: torch.Tensor, off: torch.Tensor | None,
             bits: int, gs: int, note: str) -> None:
    n = g.nodes[i]
    base = n.inputs[1]
    fdt = g.params[base].dtype if g.params[base].dtype in ("float32", "float16", "bfloat16") else "float32"
    made = {}
    for suffix, t in ((f"_q{bits}", q), ("_scales", s), ("_offsets", off)):
        if t is None:
            continue
        if t.is_floating_point():
            t = t.to(torch_dtype("float32"))
        name = fresh_name(names, base + suffix)
        g.params[name] = TensorType(str(t.dtype).replace("torch.", ""), tuple(t.shape))
        g.weights[name] = t.contiguous()
        made[suffix] = name
    bias = n.inputs[2] if len(n.inputs) > 2 else None
    ins = [n.inputs[0], made[f"_q{bits}"], made["_scales"], bias] + ([made["_offsets"]] if "_offsets" in made else [])
    g.nodes[i] = Node(n.name, "linear_wq", ins, n.outputs, {"bits": bits, "group_size": gs},
                      dict(n.meta, quantized=note, weight_dtype=fdt))


def _native(g: Graph, names: set[str], targets: list[int]) -> int:
    from portlayer.flatten.gguf_source import GGUFError, load_native

    blocks = load_native(g.meta.get("source"))
    if not blocks:
        raise GGUFError(
            f"quantize: the plan asks for 'native' but the model source {g.meta.get('source')!r} carries no "
            "GGUF block weights; compile the .gguf file itself, or use --quantize int8/int4"
        )
    done = 0
    for i in targets:
        n = g.nodes[i]
        key = f"{n.meta.get('source', '')}.weight"
        nw = blocks.get(key)
        if nw is None:
            continue
        w = g.weights[n.inputs[1]].float()
        dq = nw.dequantized()
        tol = 1e-5 if g.weights[n.inputs[1]].dtype == torch.float32 else 1e-2
        if tuple(dq.shape) != tuple(w.shape) or float((dq - w).abs().max()) > tol * max(1.0, float(w.abs().max())):
            raise GGUFError(f"quantize: the GGUF block weight for {key} does not match the captured weight "
                             f"{n.inputs[1]} (shape {tuple(dq.shape)} vs {tuple(w.shape)}); refusing to run other numbers")
        _replace(g, names, i, nw.qweight, nw.scales, nw.offsets, nw.bits, nw.group_size,
                 f"native GGUF {nw.fmt}, group {nw.group_size}")
        done += 1
    return done


def quantize(graph: Graph, ctx: PassContext) -> Graph:
    mode = ctx.options.get("weight_quantization") or ctx.plan.weight_quantization
    if mode in (None, "none"):
        return graph.copy()
    if mode not in MODES:
        raise ValueError(f"quantize: the plan asks for {mode!r}; this pass knows {', '.join(MODES)}")
    g = graph.copy()
    names = all_names(g)
    targets = _targets(g, ctx)
    if mode == "native":
        g.meta["quantization"] = {"mode": "native", "layers": _native(g, names, targets)}
    else:
        _calibrated(g, ctx, names, targets, 8 if mode == "int8" else 4)
    from portlayer.passes.dce import dce

    return dce(g)


METHODS = ("rtn", "clip", "gptq", "awq", "awq+gptq")


CALIBRATION_TOKENS = 4096  # the built-in text's length cap: X^T X full rank for K = 1536 (docs/quantization.md)


def _calibrated(g: Graph, ctx: PassContext, names: set[str], targets: list[int], bits: int) -> None:
    method = ctx.options.get("quant_method") or DEFAULT_METHOD[bits]
    if method not in METHODS:
        raise ValueError(f"quantize: quant_method {method!r} unknown; use one of {', '.join(METHODS)}")
    symmetric = ctx.options.get("symmetric")
    sym = False if symmetric is None else bool(symmetric)
    act_order = bool(ctx.options.get("act_order", False))
    damp = float(ctx.options.get("gptq_damp", 0.01))
    sequential = bool(ctx.options.get("sequential", True))
    device = torch.device(ctx.options.get("calibration_device") or "cpu")  # scripts/gpu_quality.py: cuda
    requested = ctx.options.get("group_size") or _plan_group(ctx, bits)
    mode = f"int{bits}"
    # linears reading the same activation (q/k/v, gate/up) share one Hessian: quantize them as one
    # stacked matrix (scales are per row, so splitting the result back is exact)
    shared: dict[tuple[str, int], list[int]] = {}
    for i in targets:
        k = int(g.weights[g.nodes[i].inputs[1]].shape[1])
        if bits == 4 and k % 2:
            continue
        shared.setdefault((g.nodes[i].inputs[0], pick_group(k, bits, requested)), []).append(i)
    group_of = {tuple(idx): gs for (_, gs), idx in shared.items()}
    how, label, scaled = "round-to-nearest", "round-to-nearest", [0]
    stream = {"input_ids", "positions"} <= {v.name for v in g.inputs}
    clip_output = ctx.options.get("clip", "output") == "output"  # clip search on the output error (calibrated RTN)
    opts = {"method": method, "bits": bits, "sym": sym, "act_order": act_order, "damp": damp, "clip_output": clip_output}

    def on_group(idx: list[int], x: torch.Tensor) -> torch.Tensor | None:
        xd = x.double()
        s = _quantize_group(g, names, idx, group_of[tuple(idx)], (xd.T @ xd, int(x.shape[0])), label, **opts)
        scaled[0] += len(idx) if s is not None else 0
        return None if s is None else x / s[None, :]

    if method != "rtn" and stream:
        from portlayer.passes.calibration import CALIBRATION_TEXT, token_sequences
        from portlayer.passes.sequential import run_sequential

        seqs, how = token_sequences(g, CALIBRATION_TEXT, int(ctx.options.get("calibration_tokens", CALIBRATION_TOKENS)))
        label = {"clip": "round-to-nearest", "gptq": "GPTQ", "awq": "AWQ scales + round-to-nearest",
                 "awq+gptq": "AWQ scales + GPTQ"}[method]
        label += " (act-order)" if act_order and "gptq" in method else ""
        label += ", output-error clip" if clip_output else ""
        label += ", sequential" if sequential else ""
        if sequential:  # each group calibrated on the outputs of the groups already quantized
            run_sequential(g, seqs, list(shared.values()), on_group, device)
        else:  # every group calibrated on the float model's activations
            grams: dict[int, torch.Tensor] = {}
            run_sequential(g.copy(), seqs, list(shared.values()), lambda idx, x: grams.__setitem__(idx[0], x.clone()), device)
            for idx in shared.values():
                on_group(idx, grams.pop(idx[0]))
        how = f"{label} on {how}"
    else:
        if method != "rtn":
            how = label = f"round-to-nearest ({method} needs a token-stream graph to calibrate on)"
        for (_, gs), idx in shared.items():
            _quantize_group(g, names, idx, gs, None, label, **opts)
    g.meta["quantization"] = {"mode": mode, "method": how, "group_size": requested, "layers": len(targets),
                              **({"awq_scaled_layers": scaled[0]} if "awq" in method else {})}


def _quantize_group(g: Graph, names: set[str], idx: list[int], gs: int, gram: tuple[torch.Tensor, int] | None,
                    label: str, method: str, bits: int, sym: bool, act_order: bool, damp: float,
                    clip_output: bool) -> torch.Tensor | None:
    """Quantize the linears ``idx`` (one input, stacked) in place; with AWQ first scale their input
    channels (folded upstream). Returns the AWQ scales the input must be divided by, or None."""
    dev = gram[0].device if gram is not None else torch.device("cpu")  # the calibration's device does the math
    with _single_thread() if dev.type == "cpu" else contextlib.nullcontext():
        return _quantize_group_on(g, names, idx, gs, gram, label, method, bits, sym, act_order, damp, clip_output, dev)


def _quantize_group_on(g: Graph, names: set[str], idx: list[int], gs: int, gram: tuple[torch.Tensor, int] | None,
                       label: str, method: str, bits: int, sym: bool, act_order: bool, damp: float,
                       clip_output: bool, dev: torch.device) -> torch.Tensor | None:
    from portlayer.passes.awq import apply_scale, fold_target, search_scale

    s = None
    if gram is not None and "awq" in method and (where := fold_target(g, idx)) is not None:
        w = torch.cat([g.weights[g.nodes[i].inputs[1]].float() for i in idx]).to(dev)
        s, _alpha = search_scale(w, gram[0], gram[1], bits, gs, sym, clip_output)
        apply_scale(g, idx, where, s.cpu())
        sd = s.double()
        gram = (gram[0] / sd[:, None] / sd[None, :], gram[1])
    ws = [g.weights[g.nodes[i].inputs[1]] for i in idx]
    q, sc, off = quantize_weight(torch.cat([w.float() for w in ws]).to(dev), bits, gs,
                                 gram if "gptq" in method else None, sym, act_order, damp,
                                 gram if clip_output else None)
    q, sc, off = q.cpu(), sc.cpu(), off.cpu() if off is not None else None
    row = 0
    for i, w in zip(idx, ws):
        r = slice(row, row + int(w.shape[0]))
        row += int(w.shape[0])
        kind = "symmetric" if off is None else "asymmetric"
        _replace(g, names, i, q[r], sc[r], off[r] if off is not None else None, bits, gs,
                 f"int{bits} weight-only, group {gs}, {kind}, {label}")
    return s


@contextlib.contextmanager
def _single_thread() -> Iterator[None]:
    """GPTQ's column sweep and the clip searches are many small ops: one intra-op thread avoids
    oversubscription, which on a busy 2-core host made them 15x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _plan_group(ctx: PassContext, bits: int) -> int | None:
    """The plan's group size (a policy decision when the descriptor's kernels constrain it)."""
    if bits == 8:
        return None
    try:
        v = ctx.plan.value("quant_group_size")
    except KeyError:
        v = None
    return int(v) if v else None
