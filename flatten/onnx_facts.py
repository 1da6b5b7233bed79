"""Model facts for graph.meta from an imported ONNX graph (no HF config to read them from).

The policy and the runtime read task, layer count, heads, KV shape, vocabulary and position
limits from graph.meta; here they come from the graph itself: the attention ops, the token
embedding table and the output shape.
"""

from __future__ import annotations

from typing import Any

from portlayer.flatten.ir import Graph

DEFAULT_MAX_POSITIONS = 2048


def graph_facts(g: Graph) -> dict[str, Any]:
    attn = g.find("attention")
    types = g.value_types()
    facts: dict[str, Any] = {"num_layers": len(attn), "architectures": ["OnnxModel"], "model_type": "onnx"}
    if attn:
        a = attn[0]
        k, v = types[a.inputs[1]], types[a.inputs[2]]
        facts.update(num_heads=int(a.attrs["num_heads"]), num_kv_heads=int(k.shape[1]), head_dim=int(k.shape[2]),
                     v_head_dim=int(v.shape[2]))
        causal = all(n.attrs.get("causal") for n in attn)
    else:
        causal = False
    ids_users = [n for n in g.nodes if n.op == "embedding" and any(_from_input(g, i, "input_ids") for i in n.inputs[1:])]
    if ids_users:
        w = g.params.get(ids_users[0].inputs[0])
        if w is not None:
            facts["vocab_size"], facts["hidden_size"] = int(w.shape[0]), int(w.shape[1])
    pos_tables = [g.params[n.inputs[0]] for n in g.nodes if n.op == "embedding" and n.inputs[0] in g.params
                  and any(_from_input(g, i, "positions") for i in n.inputs[1:])]
    rope = [g.params[n.inputs[2]] for n in g.nodes if n.op == "rope" and n.inputs[2] in g.params]
    tables = [int(t.shape[0]) for t in pos_tables + rope]
    facts["max_positions"] = min(tables) if tables else DEFAULT_MAX_POSITIONS
    out = types[g.outputs[0]]
    facts["task"] = "causal_lm" if causal and out.rank == 2 and out.shape[-1] == facts.get("vocab_size") else "encoder"
    facts["dtype"] = out.dtype if out.dtype.startswith(("float", "bfloat")) else "float32"
    facts["tie_word_embeddings"] = False
    return facts


def _from_input(g: Graph, value: str | None, name: str) -> bool:
    """True when ``value`` is the graph input ``name`` up to reshapes and casts."""
    prod = g.producers()
    seen = 0
    while value is not None and seen < 8:
        if value == name:
            return True
        n = prod.get(value)
        if n is None or n.op not in ("reshape", "cast"):
            return False
        value = n.inputs[0]
        seen += 1
    return False
