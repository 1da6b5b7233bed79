"""Peepholes on a freshly imported ONNX graph: the forms the aten path produces directly.

MatMul + Add(bias) -> linear with bias; x * sigmoid(x) -> silu; the TorchScript exporter's
(x * (erf(x / sqrt 2) + 1)) * 0.5 -> gelu (the aten-form raiser in patterns.py wants 0.5 * x first);
dead values removed.
"""

from __future__ import annotations

import math

from portlayer.flatten.ir import Graph, Node
from portlayer.flatten.rewrite import dce


def _scalar(n: Node | None, op: str, value: float) -> bool:
    return (n is not None and n.op == op and n.attrs.get("scalar") is not None and not n.attrs.get("reverse")
            and (len(n.inputs) < 2 or n.inputs[1] is None) and math.isclose(float(n.attrs["scalar"]), value, rel_tol=1e-6))


def _erf_gelu_input(prod: dict[str, Node], n: Node) -> str | None:
    """x when n computes (x * (erf(x / sqrt 2) + 1)) * 0.5 (or with 0.5 applied to x first)."""
    if not _scalar(n, "mul", 0.5):
        return None
    inner = prod.get(n.inputs[0])
    if inner is None or inner.op != "mul" or len(inner.inputs) != 2 or inner.inputs[1] is None:
        return None
    for x, a in ((inner.inputs[0], inner.inputs[1]), (inner.inputs[1], inner.inputs[0])):
        add = prod.get(a)
        if not _scalar(add, "add", 1.0):
            continue
        erf = prod.get(add.inputs[0])
        if erf is None or erf.op != "erf":
            continue
        d = prod.get(erf.inputs[0])
        if (_scalar(d, "div", math.sqrt(2.0)) or _scalar(d, "mul", 1 / math.sqrt(2.0))) and d.inputs[0] == x:
            return x
    return None


def cleanup(graph: Graph) -> Graph:
    g = dce(graph)
    users = g.users()
    prod = g.producers()
    drop: set[str] = set()
    rename: dict[str, str] = {}
    for n in g.nodes:
        ins = [rename.get(i, i) if i else i for i in n.inputs]
        n.inputs = ins
        if n.op == "add" and len(ins) == 2 and ins[1] is not None and n.attrs.get("scalar") is None:
            for lin_v, bias in ((ins[0], ins[1]), (ins[1], ins[0])):
                lin = prod.get(lin_v)
                if (lin is None or lin.op != "linear" or (len(lin.inputs) > 2 and lin.inputs[2]) or len(users[lin_v]) != 1
                        or bias not in g.params or g.params[bias].rank != 1
                        or g.params[bias].shape[0] != lin.outputs[0].type.shape[-1]
                        or tuple(n.outputs[0].type.shape) != tuple(lin.outputs[0].type.shape)):
                    continue
                lin.inputs = [lin.inputs[0], lin.inputs[1], bias]
                rename[n.outputs[0].name] = lin_v
                drop.add(n.name)
                break
        elif n.op == "mul" and len(ins) == 2 and ins[1] is not None:
            for x, s in ((ins[0], ins[1]), (ins[1], ins[0])):
                sg = prod.get(s)
                if sg is not None and sg.op == "sigmoid" and sg.inputs[0] == x:
                    n.op, n.inputs, n.attrs = "silu", [x], {}
                    break
        elif n.op == "mul" and (x := _erf_gelu_input(prod, n)) is not None:
            n.op, n.inputs, n.attrs = "gelu", [x], {"approximate": "none"}
    g.nodes = [n for n in g.nodes if n.name not in drop]
    g.outputs = [rename.get(o, o) for o in g.outputs]
    return dce(g)
