"""Import self-check: the token-stream graph on packed sequences vs the faithful graph on each alone.

The stream rewrite replaces length-only subgraphs by what they were proven equal to at sampled
lengths; this check runs the whole model both ways on random ids, two sequences of different
lengths packed into one stream, and refuses the import when they differ.
"""

from __future__ import annotations

import torch

from portlayer.flatten.ir import Graph
from portlayer.flatten.onnx_load import OnnxImportError

LENGTHS = (4, 7)


def faithful_feeds(graph: Graph, ids: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Inputs for the faithful graph from ids [B, S] (mask defaults to all ones)."""
    from portlayer.flatten.ir import torch_dtype

    mask = torch.ones_like(ids) if mask is None else mask
    out = {}
    for v in graph.inputs:
        dt = torch_dtype(v.type.dtype)
        if v.name == "input_ids":
            out[v.name] = ids.to(dt)
        elif v.name == "attention_mask":
            out[v.name] = mask.to(dt)
        elif v.name == "token_type_ids":
            out[v.name] = torch.zeros_like(ids, dtype=dt)
        elif v.name == "position_ids":
            out[v.name] = ((mask.cumsum(-1) - 1).clamp(min=0)).to(dt)
    return out


def check_stream(faithful: Graph, stream: Graph, where: str, tol: float = 1e-4) -> None:
    from portlayer.flatten.interpret import interpret, run_graph
    from portlayer.flatten.op_defs.attention import AttentionMetadata

    vocab = int(stream.meta.get("vocab_size") or 100)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]
    ref = [run_graph(faithful, faithful_feeds(faithful, s[None]))[0] for s in seqs]
    meta = AttentionMetadata.from_lens([len(s) for s in seqs])
    got = interpret(stream, torch.cat(seqs), attn_metadata=meta)
    total = sum(len(s) for s in seqs)
    pooled = stream.find("pooling") != [] and got.shape[0] == len(seqs)
    if not pooled and got.shape[0] != total:
        raise OnnxImportError(
            f"{where}: the graph's output has {got.shape[0]} rows for a stream of {total} tokens in {len(seqs)} "
            "sequences: it reduces across tokens (e.g. pooling written as ONNX ops), which the token-stream form "
            "cannot express per sequence. Export the model without its pooling head, or import with stream=False.")
    start = 0
    for k, (s, r) in enumerate(zip(seqs, ref)):
        g = got[k] if pooled else got[start:start + len(s)]
        r = r.reshape(g.shape) if r.numel() == g.numel() else r
        err = (g.float() - r.float()).abs().max().item() if r.shape == g.shape else float("inf")
        if not err <= tol * max(1.0, r.float().abs().max().item()):
            raise OnnxImportError(
                f"{where}: self-check failed: the token-stream graph differs from the ONNX graph itself on "
                f"sequence {k} ({len(s)} tokens packed with others): max abs error {err:.3g}. The model computes "
                "something across tokens that portlayer's stream form does not express; import with stream=False.")
        start += len(s)
