"""The Plan: every decision the policy made for one (model, device), each with its reason.

Plain data so it is written into the compiled artifact as JSON, diffed between devices,
and printed by `portlayer explain`. The inputs that produced it ride along so a user
override can re-negotiate the decisions that depend on it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from portlayer.errors import PortlayerError

LAUNCH_FAMILIES = (
    "pointwise", "reduction", "rope", "gemm", "attention_decode", "attention_prefill", "embedding",
    "reshape_and_cache", "gemv", "gemv_wq", "dequant",
)  # fmt: skip
OVERRIDABLE = ("compute_dtype", "weight_quantization", "kv_cache_dtype", "kv_block_size", "prefill_chunk_size",
               "max_batched_tokens")


@dataclass(frozen=True)
class Decision:
    name: str
    value: Any
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "reason": self.reason}


class PlanError(PortlayerError, ValueError):
    """The model cannot be planned onto the device; the message says what to change."""


@dataclass(frozen=True)
class Plan:
    model: str
    target: str
    target_sha256: str
    decisions: tuple[Decision, ...]
    overrides: Mapping[str, Any] = field(default_factory=dict)
    inputs: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __iter__(self) -> Iterator[Decision]:
        return iter(self.decisions)

    def decision(self, name: str) -> Decision:
        for d in self.decisions:
            if d.name == name:
                return d
        raise KeyError(f"plan for {self.model} on {self.target} has no decision {name!r}; have {self.names()}")

    def names(self) -> list[str]:
        return [d.name for d in self.decisions]

    def value(self, name: str) -> Any:
        return self.decision(name).value

    # Typed shortcuts for the decisions other modules read most.
    @property
    def compute_dtype(self) -> str:
        return self.value("compute_dtype")

    @property
    def weight_quantization(self) -> str:
        return self.value("weight_quantization")

    @property
    def buffer_alignment(self) -> int:
        return self.value("buffer_alignment")

    @property
    def kv_cache_dtype(self) -> str | None:
        """The KV cache's element type (None: no cache; a Plan from before this decision: the compute dtype)."""
        try:
            return self.value("kv_cache_dtype")
        except KeyError:
            return self.compute_dtype

    @property
    def kv_block_size(self) -> int | None:
        return self.value("kv_block_size")

    @property
    def prefill_chunk_size(self) -> int:
        return self.value("prefill_chunk_size")

    @property
    def max_batched_tokens(self) -> int:
        return self.value("max_batched_tokens")

    @property
    def kv_cache_budget_bytes(self) -> int:
        return self.value("kv_cache_budget_bytes")

    @property
    def max_num_seqs(self) -> int:
        return self.value("max_num_seqs")

    @property
    def graph_capture_sizes(self) -> list[int]:
        return self.value("graph_capture_sizes")

    @property
    def step_graph_tokens(self) -> list[int]:
        """Token buckets of step graphs (steps with prefill tokens); none in a Plan made before the decision."""
        return self.value("step_graph_tokens") if "step_graph_tokens" in self.names() else []

    @property
    def max_fused_inputs(self) -> int:
        return self.value("max_fused_inputs")

    def launch_config(self, family: str) -> dict[str, int]:
        """Triton launch parameters for a kernel family ({} when codegen is not Triton)."""
        if family not in LAUNCH_FAMILIES:
            raise KeyError(f"unknown kernel family {family!r}; known: {', '.join(LAUNCH_FAMILIES)}")
        return dict(self.value(f"launch.{family}"))

    @property
    def launch_configs(self) -> dict[str, dict[str, int]]:
        return {f: self.launch_config(f) for f in LAUNCH_FAMILIES}

    # ---- overrides, serialisation, display ----------------------------------------
    def with_overrides(self, **kw: Any) -> Plan:
        """Re-negotiate with user-forced values (e.g. compute_dtype='float32'); reason 'user override'."""
        bad = sorted(set(kw) - set(OVERRIDABLE))
        if bad:
            raise KeyError(f"cannot override {bad}; overridable: {', '.join(OVERRIDABLE)}")
        if not self.inputs:
            raise PlanError("this plan was loaded without its inputs; negotiate again with overrides=")
        from portlayer.capabilities.descriptor import Descriptor
        from portlayer.capabilities.policy import negotiate
        from portlayer.capabilities.requirements import ModelRequirements

        req = ModelRequirements.from_json(self.inputs["requirements"])
        desc = Descriptor.from_dict(self.inputs["descriptor"], origin=f"plan for {self.target}")
        return negotiate(req, desc, overrides={**self.overrides, **kw})

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "target": self.target,
            "target_sha256": self.target_sha256,
            "overrides": dict(self.overrides),
            "decisions": [d.to_json() for d in self.decisions],
            "inputs": dict(self.inputs),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False)

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Plan:
        return Plan(
            model=d["model"],
            target=d["target"],
            target_sha256=d["target_sha256"],
            decisions=tuple(Decision(x["name"], x["value"], x["reason"]) for x in d["decisions"]),
            overrides=dict(d.get("overrides", {})),
            inputs=dict(d.get("inputs", {})),
        )

    def table(self) -> list[tuple[str, str, str]]:
        """(decision, value, reason) rows for `portlayer explain`."""
        return [(d.name, format_value(d.name, d.value), d.reason) for d in self.decisions]

    def _repr_html_(self) -> str:
        """Notebook view: the decisions as an HTML table (capabilities/plan_view.py)."""
        from portlayer.capabilities.plan_view import plan_html

        return plan_html(self)

    def format_table(self) -> str:
        rows = self.table()
        w0 = max(len(r[0]) for r in rows)
        w1 = min(48, max(len(r[1]) for r in rows))
        head = f"Plan for {self.model} on {self.target} (descriptor sha256 {self.target_sha256[:12]})"
        lines = [head, f"{'decision':<{w0}}  {'value':<{w1}}  reason", "-" * (w0 + w1 + 60)]
        lines += [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
        return "\n".join(lines)


def format_value(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if name.endswith("_bytes") and isinstance(value, int):
        return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"
    if isinstance(value, Mapping):
        return " ".join(f"{k}={v}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(str, value)) + "]" if value else "[]"
    return str(value)
