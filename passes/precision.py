"""Cast floating-point parameters to the Plan's compute dtype and re-infer every type.

Activations follow the weights through type inference (graph inputs are integer ids and
positions), so one cast of the parameters puts the whole graph in the compute dtype. Ops
whose semantics need float32 inside (norm statistics, attention softmax) keep computing in
float32 internally, as their reference implementations say.
"""

from __future__ import annotations

from portlayer.flatten.ir import Graph, torch_dtype
from portlayer.flatten.weights_stream import cast, raw, store_of
from portlayer.passes.context import PassContext
from portlayer.passes.util import retype

FLOATS = ("float32", "float16", "bfloat16", "float64")


def precision(graph: Graph, ctx: PassContext) -> Graph:
    dtype = ctx.options.get("compute_dtype") or ctx.plan.compute_dtype
    g = graph.copy()
    changed = False
    for name, t in list(g.params.items()):
        if t.dtype in FLOATS and t.dtype != dtype:
            g.params[name] = t.with_dtype(dtype)
            if name in g.weights:  # cast when read (written, run, copied to a device): never a second copy
                g.weights = store_of(g.weights)
                g.weights[name] = cast(raw(g.weights, name), torch_dtype(dtype))
            changed = True
    if changed:
        retype(g)
    g.meta["dtype"] = dtype
    return g
