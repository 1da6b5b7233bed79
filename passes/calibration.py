"""Offline calibration data for lossy passes: two short built-in texts and the model's own tokenizer.

``calib_text.txt`` feeds the calibrated quantizer (GPTQ Hessians); ``gate_text.txt`` is held
out from it and measures the quality gate, so the gate never grades on the data the quantizer
fitted. Both ship in the wheel (setup.cfg package_data); nothing is downloaded.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from portlayer.flatten.ir import Graph
from portlayer.flatten.op_defs.attention import AttentionMetadata
from portlayer.flatten.ops import get_op

HERE = Path(__file__).resolve().parent
CALIBRATION_TEXT = "calib_text.txt"
GATE_TEXT = "gate_text.txt"


def text(name: str) -> str:
    return (HERE / name).read_text(encoding="utf-8")


def _vocab(graph: Graph) -> int:
    v = graph.meta.get("vocab_size")
    if v:
        return int(v)
    for n in graph.nodes:
        if n.op == "embedding" and n.inputs[0] in graph.params:
            return int(graph.params[n.inputs[0]].shape[0])
    return 256


def token_ids(graph: Graph, name: str, max_tokens: int = 512) -> tuple[torch.Tensor, str]:
    """(ids, how) for a built-in text: the model's tokenizer.json when the source has one, else
    deterministic pseudo-random ids (random-weight test models have no meaningful text)."""
    src = graph.meta.get("source")
    tok_file = Path(src) / "tokenizer.json" if src else None
    vocab = _vocab(graph)
    if tok_file is not None and tok_file.is_file():
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(tok_file)).encode(text(name), add_special_tokens=False).ids[:max_tokens]
        if ids and max(ids) < vocab:
            return torch.tensor(ids, dtype=torch.long), f"{name} through {tok_file.name} ({len(ids)} tokens)"
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # per text: the gate never grades on calibration ids
    n = min(max_tokens, 256)
    return torch.randint(0, vocab, (n,), generator=gen), f"{n} seeded random ids (no tokenizer.json in the source)"


def token_sequences(graph: Graph, name: str, max_tokens: int = 4096, seq_len: int = 512) -> tuple[list[torch.Tensor], str]:
    """(sequences, how): up to ``max_tokens`` of a built-in text cut into ``seq_len``-token sequences
    (several sequences: the calibration run's attention stays short and GPTQ's X^T X sees enough
    rows to be full rank), or seeded random ids where the source has no tokenizer.json."""
    ids, how = token_ids(graph, name, max_tokens)
    if "random" in how:
        ids = ids[:256]  # random-weight test models: a short stream keeps their compiles fast
        how = f"{ids.shape[0]} seeded random ids (no tokenizer.json in the source)"
    seqs = [ids[i:i + seq_len] for i in range(0, int(ids.shape[0]), seq_len)]
    seqs = [s for s in seqs if s.shape[0] >= 2]
    return seqs, f"{how}, {len(seqs)} sequences of <= {seq_len}"


def linear_inputs_gram(graph: Graph, ids: torch.Tensor, wanted: set[str]) -> dict[str, tuple[torch.Tensor, int]]:
    """{linear node name: (X^T X in float64, rows)} for the ``wanted`` linear nodes, from one float32
    run of ``graph`` (the reference ops) on the token stream ``ids`` as one sequence."""
    from portlayer.flatten.interpret import ExecContext, bind_symbols

    feeds = {"input_ids": ids, "positions": torch.arange(ids.shape[0])}
    names = {v.name for v in graph.inputs}
    if not {"input_ids", "positions"} <= names:
        raise ValueError(f"calibration runs token-stream graphs; this one takes {sorted(names)}")
    ctx = ExecContext(attn_metadata=AttentionMetadata.from_lens([int(ids.shape[0])]))
    ctx.bindings = bind_symbols(graph, {k: v for k, v in feeds.items() if k in names} | _extra_feeds(graph, ids))
    ctx.bindings.setdefault("num_seqs", 1)
    env: dict[str, torch.Tensor] = {k: (v.float() if v.is_floating_point() else v) for k, v in graph.weights.items()}
    env.update(feeds)
    env.update(_extra_feeds(graph, ids))
    out: dict[str, tuple[torch.Tensor, int]] = {}
    last = {x: i for i, n in enumerate(graph.nodes) for x in n.inputs if x is not None}
    keep = set(graph.params)
    with torch.no_grad():
        for i, n in enumerate(graph.nodes):
            args = [env[x] if x is not None else None for x in n.inputs]
            if n.name in wanted:
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                out[n.name] = (x.T @ x, int(x.shape[0]))
            for v, t in zip(n.outputs, get_op(n.op).reference(args, n.attrs, ctx)):
                env[v.name] = t
            for x in n.inputs:
                if x is not None and last.get(x) == i and x not in keep:
                    env.pop(x, None)
    return out


def _extra_feeds(graph: Graph, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """logits_indices (select_logit_rows): every row, so the LM head sees the whole stream."""
    return {v.name: torch.arange(ids.shape[0]) for v in graph.inputs if v.name == "logits_indices"}
