"""Peepholes on a freshly imported ONNX graph: the forms the aten path produces directly.

MatMul + Add(bias) -> linear with bias; x * sigmoid(x) -> silu; dead values removed.
"""

from __future__ import annotations

from portlayer.flatten.ir import Graph
from portlayer.flatten.rewrite import dce


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
    g.nodes = [n for n in g.nodes if n.name not in drop]
    g.outputs = [rename.get(o, o) for o in g.outputs]
    return dce(g)
