"""The quality gate: is a lossy graph still the same model? Pure functions over two graphs.

Both graphs run on the reference interpreter (flatten/interpret.py) in float32 on the same
token streams: the held-out built-in text passes/gate_text.txt (through the model's own
tokenizer) and the validation prompts. Measured:

- ``top1``: how often the lossy model's next-token argmax equals the float model's;
- ``mean_kl``: mean KL(float || lossy) of the next-token distributions, in nats;
- ``ppl_ratio``: perplexity of the lossy model on the text over the float model's.

Also reported, not gated: ``near_tie_flips``, how many top-1 disagreements sit where the float
model's own top two logits are within NEAR_TIE of each other; on SmolLM2 rounding the float
weights to bf16 already flips such positions (docs/quantization.md).

Float32 compute on purpose: the gate grades the weight format, not the device's arithmetic
(scripts/gpu_quality.py measures the same figures with bf16 compute on a GPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from portlayer.flatten.ir import Graph

NEAR_TIE = 0.1  # logits: a float top-1/top-2 gap below this is a near-tie


@dataclass(frozen=True)
class Thresholds:
    top1: float  # at least
    mean_kl: float  # at most (nats)
    ppl_ratio: float  # at most


#: documented in docs/quantization.md; native GGUF blocks are graded like their bit width
THRESHOLDS: dict[str, Thresholds] = {
    "int8": Thresholds(top1=0.99, mean_kl=0.01, ppl_ratio=1.01),
    "int4": Thresholds(top1=0.90, mean_kl=0.10, ppl_ratio=1.10),
    "native": Thresholds(top1=0.99, mean_kl=0.01, ppl_ratio=1.01),
}


@dataclass
class GateResult:
    mode: str
    top1: float
    mean_kl: float
    ppl_float: float
    ppl_lossy: float
    tokens: int
    text: str
    thresholds: Thresholds
    failures: list[str] = field(default_factory=list)
    near_tie_flips: int = 0

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_lossy / self.ppl_float if self.ppl_float else math.inf

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED (" + "; ".join(self.failures) + ")"
        return (f"quality gate for {self.mode}: top-1 {self.top1:.1%}, mean KL {self.mean_kl:.4f}, "
                f"perplexity ratio {self.ppl_ratio:.4f} ({self.ppl_lossy:.2f} vs {self.ppl_float:.2f}) "
                f"over {self.tokens} tokens{self._flips()}: {verdict}")

    def _flips(self) -> str:
        flips = round((1 - self.top1) * self.tokens)
        return f", {self.near_tie_flips} of {flips} top-1 flips at float near-ties (gap < {NEAR_TIE})" if flips else ""

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "top1": self.top1, "mean_kl": self.mean_kl, "ppl_float": self.ppl_float,
                "ppl_lossy": self.ppl_lossy, "ppl_ratio": self.ppl_ratio, "tokens": self.tokens, "text": self.text,
                "thresholds": asdict(self.thresholds), "passed": self.passed, "failures": list(self.failures),
                "near_tie_flips": self.near_tie_flips}


def logits_of(graph: Graph, ids: torch.Tensor, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[T, V] float32 logits of one sequence on the reference interpreter, weights in ``dtype``
    (quantization scales and offsets stay float32, as the linear_wq contract stores them)."""
    from portlayer.flatten.interpret import ExecContext, run_graph
    from portlayer.flatten.op_defs.attention import AttentionMetadata

    ids = ids.to(device)
    feeds = {"input_ids": ids, "positions": torch.arange(ids.shape[0], device=device)}
    for v in graph.inputs:
        if v.name not in feeds:  # logits_indices (select_logit_rows): every row
            feeds[v.name] = torch.arange(ids.shape[0], device=device)
    keep32 = {x for n in graph.nodes if n.op == "linear_wq" for x in n.inputs[2:5:2] if x}
    if torch.device(device).type == "cpu":  # cast per node as the interpreter reads it: no second copy of the model
        from portlayer.flatten.weights_stream import WeightStore, cast, raw

        weights = WeightStore()
        for k in graph.weights:
            w = raw(graph.weights, k)
            weights[k] = cast(w, torch.float32 if k in keep32 else dtype) if w.dtype.is_floating_point else w
    else:
        weights = {k: (w.to(device, torch.float32 if k in keep32 else dtype) if w.is_floating_point() else w.to(device))
                   for k, w in graph.weights.items()}
    ctx = ExecContext(attn_metadata=AttentionMetadata.from_lens([int(ids.shape[0])], device=device), device=device)
    with torch.no_grad():
        return run_graph(graph, feeds, ctx, weights=weights)[0].float().cpu()


def compare_logits(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor | None) -> dict[str, float]:
    """Sums over positions: agreements, KL, and (with next-token ``targets``) both NLLs."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    top2 = ref.topk(2, -1).values if ref.shape[-1] > 1 else torch.cat([ref, ref - math.inf], -1)
    flip = ref.argmax(-1) != got.argmax(-1)
    out = {"n": float(ref.shape[0]), "agree": float((~flip).sum()), "kl": float((lp.exp() * (lp - lq)).sum()),
           "near_tie_flips": float((flip & (top2[:, 0] - top2[:, 1] < NEAR_TIE)).sum())}
    if targets is not None:
        rows = torch.arange(targets.shape[0])
        out.update(nll_f=float(-lp[rows, targets].sum()), nll_q=float(-lq[rows, targets].sum()), nt=float(targets.shape[0]))
    return out


def evaluate(reference: Graph, lossy: Graph, mode: str, text_ids: torch.Tensor, text_how: str,
             prompts: Sequence[torch.Tensor] = (), device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32, reference_dtype: torch.dtype = torch.float32) -> GateResult:
    """Grade ``lossy`` against ``reference`` on the text (all metrics) and extra prompts (top-1, KL)."""
    th = THRESHOLDS.get(mode, THRESHOLDS["int4"])
    tot = {"n": 0.0, "agree": 0.0, "kl": 0.0, "nll_f": 0.0, "nll_q": 0.0, "nt": 0.0, "near_tie_flips": 0.0}
    for i, ids in enumerate([text_ids, *prompts]):
        if ids.numel() < 2 and i == 0:
            raise ValueError("quality gate: the built-in text tokenized to fewer than 2 tokens")
        r = compare_logits(logits_of(reference, ids, device, reference_dtype), logits_of(lossy, ids, device, dtype),
                           ids[1:] if i == 0 else None)
        for k, v in r.items():
            tot[k] += v
    top1, kl = tot["agree"] / tot["n"], tot["kl"] / tot["n"]
    ppl_f, ppl_q = math.exp(tot["nll_f"] / tot["nt"]), math.exp(tot["nll_q"] / tot["nt"])
    res = GateResult(mode, top1, kl, ppl_f, ppl_q, int(tot["n"]), text_how, th,
                     near_tie_flips=int(tot["near_tie_flips"]))
    if top1 < th.top1:
        res.failures.append(f"top-1 agreement {top1:.1%} < {th.top1:.0%}")
    if kl > th.mean_kl:
        res.failures.append(f"mean KL {kl:.4f} > {th.mean_kl}")
    if res.ppl_ratio > th.ppl_ratio:
        res.failures.append(f"perplexity ratio {res.ppl_ratio:.4f} > {th.ppl_ratio}")
    return res


def gate(reference: Graph, lossy: Graph, mode: str, prompts: Sequence[torch.Tensor] = (), max_tokens: int = 256,
         device: str | torch.device = "cpu") -> GateResult:
    """The gate on the built-in held-out text (passes/gate_text.txt) plus ``prompts``, run on ``device``."""
    from portlayer.passes.calibration import GATE_TEXT, token_ids

    ids, how = token_ids(reference, GATE_TEXT, max_tokens)
    return evaluate(reference, lossy, mode, ids, how, prompts, device=device)
