"""Readable value names derived from the HF module each node came from."""

from __future__ import annotations

import re

from portlayer.flatten.ir import Graph, Node, Value

_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?=\.|$)")
_DROP_PREFIX = ("model.", "transformer.", "encoder.", "bert.", "gpt_neox.", "decoder.")


def short_source(source: str) -> str:
    s = source
    for p in _DROP_PREFIX:
        s = s.removeprefix(p)
    s = _LAYER.sub(lambda m: f".l{m.group(1)}_", "." + s).lstrip(".")
    s = s.replace("_.", "_").replace(".", "_")
    return s.strip("_")


def rename_from_source(graph: Graph) -> Graph:
    """Rename node outputs to ``<module>_<op>`` (``l0_self_attn_q_proj`` for its linear).

    Only names change; structure and order do not, so this is safe at any point.
    """
    g = graph.copy()
    taken = {v.name for v in g.inputs} | set(g.params)
    mapping: dict[str, str] = {}
    counts: dict[str, int] = {}
    nodes: list[Node] = []
    for n in g.nodes:
        src = n.meta.get("source")
        base = short_source(src) if src and src != "<top level>" else ""
        leaf_linear = n.op == "linear" and base and not base.endswith(("attn", "attention", "mlp"))
        stem = base if leaf_linear else (f"{base}_{n.op}" if base else n.op)
        stem = re.sub(r"[^0-9A-Za-z_]", "_", stem) or n.op
        outs = []
        for k, v in enumerate(n.outputs):
            cand = stem if k == 0 else f"{stem}_out{k}"
            i = counts.get(cand, 0)
            name = cand if (i == 0 and cand not in taken) else f"{cand}_{i}"
            while name in taken:
                i += 1
                name = f"{cand}_{i}"
            counts[cand] = i + 1
            taken.add(name)
            mapping[v.name] = name
            outs.append(Value(name, v.type))
        ins = [mapping.get(i, i) if i is not None else None for i in n.inputs]
        nodes.append(Node(outs[0].name if outs else n.name, n.op, ins, outs, dict(n.attrs), dict(n.meta)))
    g.nodes = nodes
    g.outputs = [mapping.get(o, o) for o in g.outputs]
    return g
