"""Capture checks itself against the HF model's own forward before anything is served.

A captured graph can agree with HF at short lengths and diverge past a boundary the model
has (a sliding window, a local-attention span, a chunk): wrong tokens from the first one
generated, with no error. So after capture the graph is run by the reference interpreter on
random ids at lengths that cross every such boundary (1, a short length, and past twice the
largest window) and compared with HF's eager forward. On a mismatch the capture is refused
with the first layer (in graph order) whose output differs, and the length that shows it.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from portlayer.flatten.capture import CaptureError
from portlayer.flatten.ir import Graph

_LAYER = re.compile(r"\.\d+$")
_WINDOW_KEYS = ("sliding_window", "attention_chunk_size", "local_attention", "chunk_size")


class SelfCheckError(CaptureError):
    """The captured graph does not compute what the HF model computes."""


def check_lengths(graph: Graph, config: Any = None, max_positions: int | None = None) -> list[int]:
    """1, a short length, and one past twice the largest window/chunk the model has."""
    spans = [int(n.attrs.get("sliding_window") or 0) for n in graph.find("attention")]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in _WINDOW_KEYS:
        v = getattr(text, key, None) if text is not None else None
        if isinstance(v, int) and not isinstance(v, bool):
            spans.append(v)
    long = max(33, 2 * max(spans, default=0) + 3)
    if max_positions:
        long = min(long, int(max_positions))
    return sorted({1, min(9, long), long})


def tolerance(dtype: str, ref: torch.Tensor) -> float:
    """Relative to the output's scale; half precision differs from HF's eager op order."""
    rel = 1e-3 if dtype in ("float32", "float64") else 5e-2
    return rel * max(1.0, float(ref.abs().max()))


def _hf_forward(model: torch.nn.Module, ids: torch.Tensor, names: list[str]) -> tuple[torch.Tensor, dict]:
    mods = dict(model.named_modules())
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name in names:
        def hook(_m, _i, out, name=name):  # noqa: ANN001
            t = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(t, torch.Tensor):
                seen[name] = t.detach()
        hooks.append(mods[name].register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(input_ids=ids[None])
    finally:
        for h in hooks:
            h.remove()
    res = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    return res[0], seen


def _layer_values(graph: Graph, model: torch.nn.Module) -> dict[str, str]:
    """HF layer module name -> the graph value its last node produced (graph order)."""
    layers = [n for n, _ in model.named_modules() if _LAYER.search(n)]
    last: dict[str, str] = {}
    for node in graph.nodes:
        src = str(node.meta.get("source", ""))
        for name in layers:
            if src == name or src.startswith(name + "."):
                last[name] = node.outputs[0].name
    return last


def self_check(graph: Graph, model: torch.nn.Module, *, seed: int = 0) -> list[int]:
    """Raise SelfCheckError naming the first differing layer output; returns the lengths run."""
    from portlayer.flatten.interpret import run_graph

    facts = graph.meta
    vocab = int(facts.get("vocab_size") or 8)
    lengths = check_lengths(graph, getattr(model, "config", None), facts.get("max_positions"))
    layer_vals = _layer_values(graph, model)
    probe = graph.copy()
    probe.outputs = list(graph.outputs) + [v for v in layer_vals.values() if v not in graph.outputs]
    impl = getattr(model.config, "_attn_implementation", None)
    experts = getattr(model.config, "_experts_implementation", None)
    model.set_attn_implementation("eager")
    if experts not in (None, "eager"):
        model.set_experts_implementation("eager")
    gen = torch.Generator().manual_seed(seed)
    try:
        for n in lengths:
            ids = torch.randint(min(3, vocab - 1), vocab, (n,), generator=gen)
            feeds = {"input_ids": ids, "positions": torch.arange(n)}
            outs = run_graph(probe, {v.name: feeds[v.name] for v in probe.inputs})
            env = dict(zip(probe.outputs, outs))
            ref, seen = _hf_forward(model, ids, list(layer_vals))
            got = env[graph.outputs[0]]
            tol = tolerance(str(facts.get("dtype", "float32")), ref)
            err = float((got.float() - ref.float()).abs().max()) if got.shape == ref.shape else float("inf")
            if err <= tol:
                continue
            where, detail = "the final output", f"{graph.outputs[0]!r}"
            for name, val in layer_vals.items():
                h, g = seen.get(name), env.get(val)
                if h is None or g is None or h.numel() != g.numel():
                    continue
                lerr = float((g.float().reshape(-1) - h.float().reshape(-1)).abs().max())
                if lerr > tolerance(str(facts.get("dtype", "float32")), h):
                    where, detail, err = f"layer {name}", f"graph value {val!r}", lerr
                    break
            raise SelfCheckError(
                f"self-check: the captured graph of {type(model).__name__} differs from the model's own forward "
                f"at {n} tokens; first differing output: {where} ({detail}), max abs error {err:.3g} "
                f"(tolerance {tol:.3g}). The capture is refused rather than served silently wrong; please report "
                "it with the model's config. --no-verify (capture(..., verify=False)) skips this check."
            )
    finally:
        if impl is not None:
            model.set_attn_implementation(impl)
        if experts not in (None, "eager"):
            model.set_experts_implementation(experts)
    return lengths
