"""What ``portlayer inspect --target`` adds to its JSON: passes run, kernels with their member
nodes, the implementation chosen per node with refused candidates and reasons, memory summary."""

from __future__ import annotations

from typing import Any


def report(result: Any) -> dict[str, Any]:
    g = result.graph
    out: dict[str, Any] = {
        "target": result.descriptor.name,
        "plan": {d.name: d.value for d in result.plan.decisions if not d.name.startswith("launch.")},
        "passes": [{"name": n, **s} for n, s in result.history],
    }
    if any("impl" in n.meta for n in g.nodes):
        out["selection"] = {
            n.name: {"op": n.op, "impl": n.meta.get("impl"), "impl_family": n.meta.get("impl_family"),
                     **({"fused_into": n.meta["fused_into"]} if "fused_into" in n.meta else {}),
                     "refused": n.meta.get("refused", [])}
            for n in g.nodes
        }
    if "kernels" in g.meta:
        out["kernels"] = g.meta["kernels"]
        out["fusion"] = {k: v for k, v in g.meta.get("fusion", {}).items() if k != "refused"}
        out["fusion"]["nodes_before_fusion"] = len(g.nodes)
    if "memory_plan" in g.meta:
        m = g.meta["memory_plan"]
        out["memory_plan"] = {
            "alignment": m["alignment"], "buffers": len(m["buffers"]), "arena_bytes": m["arena_bytes"],
            "peak_bytes": m["peak_bytes"], "no_reuse_bytes": m["no_reuse_bytes"],
            "inplace": sum(1 for b in m["buffers"].values() if "inplace_of" in b), "checked_pairs": m["checked_pairs"],
        }
    return out
