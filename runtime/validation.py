"""The validation set: inputs plus reference outputs fixed at compile time, re-run anywhere.

Reference outputs come from the reference interpreter on the captured graph in float32,
so they are the model's semantics, not another device's rounding. `validate` runs the
same inputs through the artifact's executable on the local device and compares the
max error per output with a tolerance chosen by the dtype (and quantization) it runs in:
the habit of validating on every hardware change, made a command.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from portlayer.flatten.ir import Graph
from portlayer.flatten.logits import feed_last_rows
from portlayer.flatten.op_defs.attention import AttentionMetadata

FORMAT = "portlayer.validation"

#: (atol, rtol): pass when max|out - ref| <= atol + rtol * max|ref|. fp32 allows TF32 GEMMs.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 2e-3),
    "float16": (5e-3, 1e-2),
    "bfloat16": (1e-2, 4e-2),
}
#: extra relative error a float8 KV cache is allowed in the steps that read one (Plan kv_cache_dtype; measured in
#: tests/test_kv_cache_fp8.py and docs/performance.md)
KV_RTOL = {"float8_e4m3fn": 5e-2}
#: extra relative error weight-only quantization is allowed (measured on tiny models; revisit on real ones)
QUANT_RTOL = {"none": 0.0, "int8": 5e-2, "int4": 0.2, "native": 1e-2}  # native: a GGUF file's own blocks (docs/quantization.md)


@dataclass
class Step:
    """One executable call: new tokens per sequence (``lens``) after ``context`` cached ones."""

    lens: list[int]
    context: list[int]
    input_ids: torch.Tensor
    positions: torch.Tensor
    outputs: list[torch.Tensor] = field(default_factory=list)


@dataclass
class Case:
    name: str
    steps: list[Step]
    paged: bool  # whether the steps share a paged KV cache


# ---- metadata and caches (shared with bench) ------------------------------------------------
def attention_layers(graph: Graph) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((Hkv, D_k), (Hkv, D_v)) per attention layer, in ``layer`` order."""
    types = graph.value_types()
    nodes = sorted(graph.find("attention"), key=lambda n: int(n.attrs.get("layer", 0)))
    out = []
    for n in nodes:
        k, v = types[n.inputs[1]], types[n.inputs[2]]
        out.append(((int(k.shape[1]), int(k.shape[2])), (int(v.shape[1]), int(v.shape[2]))))
    for n in sorted(graph.find("mla_attention"), key=lambda n: int(n.attrs.get("layer", 0))):  # latent cache
        out.append(((1, int(n.attrs["kv_lora_rank"]) + int(n.attrs["qk_rope_head_dim"])), (1, 0)))
    return out


def blocks_per_seq(max_len: int, block_size: int) -> int:
    return max(1, math.ceil(max_len / block_size))


def step_metadata(
    lens: Sequence[int], context: Sequence[int], *, block_size: int | None, max_len: int, device: torch.device | str
) -> AttentionMetadata:
    """Metadata for one step; with ``block_size``, sequence b owns a contiguous run of blocks."""
    md = AttentionMetadata.from_lens(list(lens), device=device)
    total = [c + n for c, n in zip(context, lens)]
    md.seq_lens = torch.tensor(total, dtype=torch.int32, device=device)
    md.max_seq_len = max(total, default=0)
    if block_size is None:
        return md
    per = blocks_per_seq(max_len, block_size)
    md.block_tables = torch.arange(len(lens) * per, dtype=torch.int32, device=device).view(len(lens), per)
    slots = []
    for b, (c, n) in enumerate(zip(context, lens)):
        for pos in range(c, c + n):
            slots.append((b * per + pos // block_size) * block_size + pos % block_size)
    md.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    return md


def new_kv_cache(
    graph: Graph, num_seqs: int, max_len: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    blocks = num_seqs * blocks_per_seq(max_len, block_size)
    return [
        (torch.zeros(blocks, block_size, hk, dk, dtype=dtype, device=device),
         torch.zeros(blocks, block_size, hv, dv, dtype=dtype, device=device))
        for (hk, dk), (hv, dv) in attention_layers(graph)
    ]  # fmt: skip


# ---- building the set at compile time -------------------------------------------------------
def _tokens(gen: torch.Generator, vocab: int, lens: Sequence[int], context: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (sum(lens),), generator=gen, dtype=torch.int64)
    pos = torch.cat([torch.arange(c, c + n, dtype=torch.int64) for c, n in zip(context, lens)])
    return ids, pos


def build_cases(graph: Graph, seed: int = 0) -> list[Case]:
    """Prefill of one sequence, two packed sequences, and (for causal LMs) prefill + decode on a paged cache."""
    gen = torch.Generator().manual_seed(seed)
    vocab = int(graph.meta.get("vocab_size") or 0) or _vocab_from_graph(graph)
    cases = [Case("prefill", [Step([7], [0], *_tokens(gen, vocab, [7], [0]))], paged=False)]
    cases.append(Case("packed", [Step([5, 3], [0, 0], *_tokens(gen, vocab, [5, 3], [0, 0]))], paged=False))
    if graph.meta.get("task", "causal_lm") == "causal_lm" and (graph.find("attention") or graph.find("mla_attention")):
        pre = Step([6, 4], [0, 0], *_tokens(gen, vocab, [6, 4], [0, 0]))
        dec = Step([1, 1], [6, 4], *_tokens(gen, vocab, [1, 1], [6, 4]))
        cases.append(Case("decode", [pre, dec], paged=True))
    return cases


def _vocab_from_graph(graph: Graph) -> int:
    for n in graph.nodes:
        if n.op == "embedding" and n.inputs[0] in graph.params:
            return int(graph.params[n.inputs[0]].shape[0])
    return 2


def max_len(case: Case) -> int:
    return max(c + n for s in case.steps for c, n in zip(s.context, s.lens))


def run_case(executable: Any, graph: Graph, case: Case, block_size: int) -> list[list[torch.Tensor]]:
    """Outputs of every step of a case on ``executable`` (anything with run/device/dtype)."""
    dev = executable.device
    limit = max_len(case)
    from portlayer.codegen.host_support import kv_cache_dtype

    caches = (new_kv_cache(graph, len(case.steps[0].lens), limit, block_size, kv_cache_dtype(executable), dev)
              if case.paged else None)
    outs = []
    for s in case.steps:
        md = step_metadata(s.lens, s.context, block_size=block_size if case.paged else None, max_len=limit, device=dev)
        feeds = {"input_ids": s.input_ids.to(dev), "positions": s.positions.to(dev)}
        feed_last_rows(feeds, [v.name for v in graph.inputs], md)
        outs.append([o.detach() for o in executable.run(feeds, md, caches)])
    return outs


class _Reference:
    """The reference interpreter in float32 on the CPU: what every device is compared with."""

    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, graph: Graph) -> None:
        from portlayer.flatten.weights_stream import cast_view
        from portlayer.runtime.executable import ReferenceExecutable

        self.inner = ReferenceExecutable(graph)
        self.inner.weights = cast_view(graph.weights, torch.float32)  # per node as it runs: no float32 copy of the model

    def run(self, feeds, attn_metadata, kv_caches):
        return [o.float() for o in self.inner.run(feeds, attn_metadata, kv_caches)]


def compute_reference(graph: Graph, block_size: int, seed: int = 0) -> list[Case]:
    """The validation set: every case's steps on the float32 reference interpreter, run node by node side
    by side (runtime/lockstep.py), so each weight is cast to float32 once, not once per step; the
    outputs are run_case's on ``_Reference``, bit for bit."""
    from portlayer.flatten.weights_stream import cast_view
    from portlayer.runtime.lockstep import run_lockstep

    cases = build_cases(graph, seed)
    steps, runs = [], []
    dev = _Reference.device
    for c in cases:
        limit = max_len(c)
        caches = new_kv_cache(graph, len(c.steps[0].lens), limit, block_size, _Reference.dtype, dev) if c.paged else None
        for s in c.steps:
            md = step_metadata(s.lens, s.context, block_size=block_size if c.paged else None, max_len=limit, device=dev)
            feeds = {"input_ids": s.input_ids.to(dev), "positions": s.positions.to(dev)}
            feed_last_rows(feeds, [v.name for v in graph.inputs], md)
            steps.append(s)
            runs.append((feeds, md, caches))
    for s, outs in zip(steps, run_lockstep(graph, runs, cast_view(graph.weights, torch.float32), dev)):
        s.outputs = [o.float().detach() for o in outs]
    return cases


# ---- (de)serialisation -------------------------------------------------------------------
def to_files(cases: list[Case], graph: Graph, block_size: int, seed: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(validation.json document, tensors for validation.safetensors)."""
    tensors: dict[str, torch.Tensor] = {}
    doc_cases = []
    for c in cases:
        steps = []
        for i, s in enumerate(c.steps):
            p = f"{c.name}.{i}"
            tensors[p + ".input_ids"], tensors[p + ".positions"] = s.input_ids.contiguous(), s.positions.contiguous()
            for j, o in enumerate(s.outputs):
                tensors[f"{p}.out{j}"] = o.contiguous().cpu()
            steps.append({"lens": s.lens, "context": s.context, "outputs": len(s.outputs)})
        doc_cases.append({"name": c.name, "paged": c.paged, "steps": steps})
    doc = {
        "format": FORMAT,
        "format_version": 1,
        "reference": "flatten/interpret.py reference ops, float32, CPU, on the captured graph",
        "seed": seed,
        "kv_block_size": block_size,
        "output_names": list(graph.outputs),
        "tolerances": {k: {"atol": a, "rtol": r} for k, (a, r) in TOLERANCES.items()},
        "quantization_rtol": QUANT_RTOL,
        "cases": doc_cases,
    }
    return doc, tensors


def from_files(doc: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[Case]:
    cases = []
    for c in doc["cases"]:
        steps = []
        for i, s in enumerate(c["steps"]):
            p = f"{c['name']}.{i}"
            outs = [tensors[f"{p}.out{j}"] for j in range(s["outputs"])]
            steps.append(Step(list(s["lens"]), list(s["context"]), tensors[p + ".input_ids"], tensors[p + ".positions"], outs))
        cases.append(Case(c["name"], steps, bool(c["paged"])))
    return cases


# ---- validating on the local device -------------------------------------------------------
@dataclass(frozen=True)
class Row:
    case: str
    step: int
    output: str
    max_abs_err: float
    tolerance: float
    ok: bool
    note: str = ""


@dataclass
class ValidationReport:
    device: str
    dtype: str
    quantization: str
    rows: list[Row]

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "dtype": self.dtype, "quantization": self.quantization, "ok": self.ok,
                "rows": [r.__dict__ for r in self.rows]}

    def format_table(self) -> str:
        head = f"validation on {self.device} ({self.dtype}, quantization {self.quantization})"
        lines = [head, f"{'case':<9} {'step':>4}  {'output':<16} {'max abs err':>12} {'tolerance':>12}  result"]
        for r in self.rows:
            verdict = "ok" if r.ok else "FAIL" + (f" ({r.note})" if r.note else "")
            lines.append(f"{r.case:<9} {r.step:>4}  {r.output[:16]:<16} {r.max_abs_err:>12.3e} {r.tolerance:>12.3e}  {verdict}")
        lines.append("PASSED" if self.ok else "FAILED: outputs differ from the reference beyond tolerance")
        return "\n".join(lines)


def tolerance_for(dtype: str, quantization: str) -> tuple[float, float]:
    atol, rtol = TOLERANCES.get(dtype, TOLERANCES["bfloat16"])
    return atol, rtol + QUANT_RTOL.get(quantization, 0.2)


def compare(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> tuple[float, float, bool, str]:
    tol = atol + rtol * float(ref.abs().max()) if ref.numel() else atol
    if tuple(out.shape) != tuple(ref.shape):
        return math.inf, tol, False, f"shape {tuple(out.shape)}, reference {tuple(ref.shape)}"
    o = out.detach().to("cpu", torch.float64)
    if not torch.isfinite(o).all():
        return math.inf, tol, False, "non-finite values"
    err = float((o - ref.double()).abs().max()) if ref.numel() else 0.0
    return err, tol, err <= tol, ""


def validate(executable: Any, graph: Graph, cases: list[Case], block_size: int, output_names: Sequence[str],
             quantization: str = "none", exact_reference: bool = False) -> ValidationReport:
    """Run every case on ``executable`` and compare each output with its reference.

    ``exact_reference``: the references were computed from the quantized graph itself, so the
    quantization allowance is not added (the generated code must match its own semantics)."""
    from portlayer.codegen.host_support import kv_cache_dtype

    dtype = str(executable.dtype).removeprefix("torch.")
    atol, rtol = tolerance_for(dtype, "none" if exact_reference else quantization)
    kv_rtol = KV_RTOL.get(str(kv_cache_dtype(executable)).removeprefix("torch."), 0.0)  # a float8 cache's rounding
    rows = []
    for c in cases:
        for i, (s, outs) in enumerate(zip(c.steps, run_case(executable, graph, c, block_size))):
            for j, (o, ref) in enumerate(zip(outs, s.outputs)):
                name = output_names[j] if j < len(output_names) else f"out{j}"
                err, tol, ok, note = compare(o, ref, atol, rtol + (kv_rtol if c.paged else 0.0))
                rows.append(Row(c.name, i, name, err, tol, ok, note))
    return ValidationReport(str(executable.device), dtype, quantization, rows)
