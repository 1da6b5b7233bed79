"""Compute logits only for the rows that are sampled.

A causal LM's captured graph applies ``lm_head`` to every token of the stream. The runtime
samples one row per sequence (the last prompt token, or the decode token), so a 1,024-token
prefill on a 151,936-word vocabulary would compute and write ~1,023 logits rows for nothing.
:func:`select_logit_rows` adds a graph input ``logits_indices: int64[num_seqs]`` and gathers
those rows of the hidden state right before the vocabulary projection; every op after the
gather is per-token, so the output simply becomes ``[num_seqs, vocab]``.
"""

from __future__ import annotations

from portlayer.flatten.ir import Graph, Node, TensorType, Value
from portlayer.flatten.ops import get_op

LOGITS_INDICES = "logits_indices"


def _squeezes(a: tuple, b: tuple) -> bool:
    """``a`` and ``b`` are the same shape but for dims of size 1 (a reshape that adds or drops a batch dim)."""
    return [d for d in a if d != 1] == [d for d in b if d != 1]


def _lm_head(graph: Graph) -> Node | None:
    """The vocabulary projection: the last linear on the output's producer chain, with only
    per-token pointwise ops (e.g. Gemma-2's logit softcap) and reshapes that add or drop size-1 dims
    (Falcon keeps a batch dim until its last op) after it."""
    prod = graph.producers()
    types = graph.value_types()
    (out,) = graph.outputs
    n = prod.get(out)
    while n is not None and n.op != "linear":
        kind = get_op(n.op).kind
        tensor_ins = [i for i in n.inputs if i is not None and i in prod]
        if len(tensor_ins) != 1:
            return None
        if kind == "view" and not (n.op == "reshape" and _squeezes(tuple(types[tensor_ins[0]].shape),
                                                                    tuple(n.outputs[0].type.shape))):
            return None
        if kind not in ("pointwise", "view"):
            return None
        n = prod[tensor_ins[0]]
    return n


def select_logit_rows(graph: Graph) -> Graph:
    """A copy of ``graph`` whose logits are computed only at ``logits_indices``.

    Graphs that are not causal LMs, or whose output is not reached from a vocabulary
    projection through per-token ops, are returned unchanged (a copy).
    """
    g = graph.copy()
    if g.meta.get("task") != "causal_lm" or len(g.outputs) != 1 or any(v.name == LOGITS_INDICES for v in g.inputs):
        return g
    head = _lm_head(g)
    if head is None:
        return g
    x = head.inputs[0]
    types = g.value_types()
    token = g.meta.get("token_symbol", "num_tokens")
    dims = [i for i, d in enumerate(types[x].shape) if d == token]
    if len(dims) != 1:  # no single token dim to gather along
        return g
    g.inputs.append(Value(LOGITS_INDICES, TensorType("int64", ("num_seqs",))))
    gather_name = f"{head.name}_rows"
    gather_t = get_op("index_select").infer([types[x], TensorType("int64", ("num_seqs",))], {"dim": dims[0]})[0]
    gather = Node(gather_name, "index_select", [x, LOGITS_INDICES], [Value(gather_name, gather_t)], {"dim": dims[0]},
                  {"source": head.meta.get("source", "lm_head"), "why": "logits only for sampled rows"})
    start = g.nodes.index(head)
    g.nodes.insert(start, gather)
    head.inputs = [gather_name] + head.inputs[1:]
    types[gather_name] = gather_t
    for n in g.nodes[start + 1:]:  # re-infer the per-token tail: [num_tokens, V] -> [num_seqs, V]
        if n.op == "reshape":  # its target shape names the token dim: now one row per sequence
            n.attrs = {**n.attrs, "shape": ["num_seqs" if d == token else d for d in n.attrs["shape"]]}
        ins = [types[i] if i is not None else None for i in n.inputs]
        outs = get_op(n.op).infer(ins, n.attrs)
        n.outputs = [Value(v.name, t) for v, t in zip(n.outputs, outs)]
        for v in n.outputs:
            types[v.name] = v.type
    g.meta["logits_indices"] = True
    return g


def feed_last_rows(feeds: dict, input_names, attn_metadata) -> dict:
    """Add ``logits_indices`` = the last stream row of every sequence, when the program takes it.

    ``input_names``: the program's (or graph's) input names. Used by validation and the
    benchmark; the runtime passes exactly the rows it samples instead.
    """
    if LOGITS_INDICES in set(input_names):
        feeds[LOGITS_INDICES] = (attn_metadata.query_start_loc[1:].long() - 1).to(feeds["input_ids"].device)
    return feeds
