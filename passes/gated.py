"""The pass pipeline behind the quality gate: a lossy weight format the policy picked by default
is kept only when passes/quality_gate.py measures it within thresholds; otherwise the policy
plans again with the measured rejection and falls back (int4 -> int8 -> none, or native ->
the policy's own pick). An explicit choice is never replaced: it is compiled and flagged
(``GateOutcome.warning``), and the caller refuses it under ``strict``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from portlayer.capabilities.descriptor import Descriptor
from portlayer.capabilities.policy import GATE_REJECTED
from portlayer.flatten.ir import Graph
from portlayer.passes.pipeline import PipelineResult, run_pipeline
from portlayer.passes.quality_gate import GateResult, gate

LOSSLESS = ("none", None)


@dataclass
class GateOutcome:
    result: PipelineResult
    gate: GateResult | None  # the measurement of the format finally compiled (None: lossless)
    rejected: list[GateResult] = field(default_factory=list)
    explicit: bool = False

    @property
    def warning(self) -> str | None:
        if self.gate is None or self.gate.passed:
            return None
        who = f"--quantize {self.gate.mode}" if self.explicit else f"{self.gate.mode} (nothing that passes fits memory)"
        return (f"{who} is below the quality gate's thresholds: {'; '.join(self.gate.failures)}. The artifact's "
                "answers may differ from the float model's; pass --strict to refuse such a compile, or choose a wider format")

    def to_json(self) -> dict[str, Any]:
        return {"compiled": self.gate.to_json() if self.gate else None,
                "rejected": [r.to_json() for r in self.rejected], "explicit": self.explicit,
                "warning": self.warning}

    def lines(self) -> list[str]:
        out = [f"rejected: {r.summary()}" for r in self.rejected]
        if self.gate is not None:
            out.append(self.gate.summary())
        return out


def measurable(graph: Graph) -> bool:
    """The gate needs next-token logits of a token stream: causal LMs."""
    names = {v.name for v in graph.inputs}
    return graph.meta.get("task") == "causal_lm" and {"input_ids", "positions"} <= names


def run_gated(graph: Graph, descriptor: Descriptor | str, overrides: Mapping[str, Any] | None = None,
              prompts: Sequence[torch.Tensor] = (), say: Callable[[str], None] | None = None,
              max_rounds: int = 3, device: str | None = None) -> GateOutcome:
    """run_pipeline, then the gate on the lossy format it chose; re-plan on a default pick that fails.
    ``device``: where the quantize pass calibrates (its ``calibration_device``) and the gate runs (default cpu)."""
    say = say or (lambda _m: None)
    overrides = dict(overrides or {})
    explicit = overrides.get("weight_quantization") not in LOSSLESS
    rejected: dict[str, str] = {}
    failed: list[GateResult] = []
    for _ in range(max_rounds):
        ov = dict(overrides, **({GATE_REJECTED: dict(rejected)} if rejected else {}))
        result = run_pipeline(graph, descriptor, overrides=ov,
                              **({"options": {"calibration_device": device}} if device else {}))
        mode = result.plan.weight_quantization
        if mode in LOSSLESS:
            return GateOutcome(result, None, failed, explicit)
        if not measurable(graph):
            if explicit or mode in rejected:
                return GateOutcome(result, None, failed, explicit)
            rejected[mode] = (f"not measured: the gate grades next-token distributions and this graph's task is "
                              f"{graph.meta.get('task')!r}, so a lossy format is not picked by default")
            continue
        say(f"quality gate for {mode}")
        g = gate(graph, result.graph, mode, prompts, device=device or "cpu")
        if g.passed or explicit or mode in rejected:
            return GateOutcome(result, g, failed, explicit)
        failed.append(g)
        rejected[mode] = (f"measured top-1 {g.top1:.1%}, mean KL {g.mean_kl:.4f}, perplexity ratio "
                          f"{g.ppl_ratio:.4f}: {'; '.join(g.failures)}")
    raise RuntimeError(f"quality gate: no format passed after {max_rounds} rounds: {rejected}")
