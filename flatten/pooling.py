"""Append sentence-embedding pooling (and L2 normalisation) to an encoder graph."""

from __future__ import annotations

from portlayer.flatten.ir import Graph, GraphBuilder


def append_pooling(graph: Graph, mode: str, normalize: bool) -> Graph:
    """hidden [num_tokens, H] -> pooling(mode) [num_seqs, H] -> l2_normalize when asked."""
    g = graph.copy()
    b = GraphBuilder(g)
    (hidden,) = g.outputs
    out = b.add1("pooling", [hidden], {"mode": mode}, name="pooled", meta={"source": "sentence_transformers.Pooling"})
    if normalize:
        out = b.add1("l2_normalize", [out], {"dim": -1}, name="embedding",
                     meta={"source": "sentence_transformers.Normalize"})
    g.outputs = [out]
    g.meta["task"] = "embedding"
    g.meta["pooling"] = mode
    g.meta["normalize"] = normalize
    return g
