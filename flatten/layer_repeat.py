"""Capture identical decoder layers once: export the first three, repeat the third (issue 20).

torch.export, the aten conversion and the pattern rewrites cost time per layer: most of a big
model's capture. When every layer of the model is the same module structure (same classes,
parameter shapes and scalar attributes; per-layer config lists uniform), the model is exported
with its layer list cut to three layers; layers 1 and 2 are then checked to be the same
program (node by node: op, attrs, types, and inputs that correspond layer-for-layer), and
layer 2 is repeated for layers 3..N-1 with each copy bound to its own layer's weights by name.
Anything else (mixed layer kinds, a rewrite that made per-layer tensors, a node outside the
layer order) returns None and capture exports the whole model. The capture self-check then
runs the repeated graph against the full model's own forward, so a wrong repetition is refused,
never served; repetition is only used with the self-check on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from portlayer.flatten.ir import Graph, Node, Value

KEEP = 3  # layers exported: 0 (reads the embeddings), 1 and 2 (read a layer's outputs; compared)
_SCALARS = (int, float, str, bool, type(None))


def _text_config(model: torch.nn.Module) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _signature(layer: torch.nn.Module) -> tuple:
    """What makes two layers the same program: classes, tensor shapes/dtypes, scalar attributes."""
    rows = []
    for name, m in layer.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(m).items()
                             if not k.startswith("_") and k not in ("layer_idx", "training") and isinstance(v, _SCALARS)))
        params = tuple((k, tuple(p.shape), p.dtype) for k, p in m.named_parameters(recurse=False))
        bufs = tuple((k, tuple(b.shape), b.dtype) for k, b in m.named_buffers(recurse=False))
        rows.append((name, type(m).__qualname__, attrs, params, bufs))
    return tuple(rows)


def uniform_layers(model: torch.nn.Module) -> str | None:
    """The qualified name of the model's layer list when all its layers are the same program (and
    there are more than KEEP of them), else None."""
    text = _text_config(model)
    n = getattr(text, "num_hidden_layers", None)
    if not isinstance(n, int) or n <= KEEP:
        return None
    for value in vars(text).values():  # a per-layer list (layer_types, no_rope_layers, ...) must be uniform
        if isinstance(value, (list, tuple)) and len(value) == n and any(v != value[0] for v in value):
            return None
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    if len(lists) != 1:
        return None
    name, layers = lists[0]
    first = _signature(layers[0])
    if any(_signature(layer) != first for layer in layers):
        return None
    return name


@contextlib.contextmanager
def truncated(model: torch.nn.Module, container: str) -> Iterator[None]:
    """The model with its layer list (and num_hidden_layers, per-layer lists) cut to KEEP layers."""
    parent_name, _, attr = container.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    full = getattr(parent, attr)
    text = _text_config(model)
    n = text.num_hidden_layers
    saved = {k: v for k, v in vars(text).items() if isinstance(v, (list, tuple)) and len(v) == n}
    setattr(parent, attr, torch.nn.ModuleList(list(full)[:KEEP]))
    text.num_hidden_layers = KEEP
    for k, v in saved.items():
        setattr(text, k, type(v)(v[:KEEP]))
    try:
        yield
    finally:
        setattr(parent, attr, full)
        text.num_hidden_layers = n
        for k, v in saved.items():
            setattr(text, k, v)


def _layer_of(source: str, prefix: str) -> int | None:
    if not source.startswith(prefix):
        return None
    head = source[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _with_layer(source: str, prefix: str, k: int) -> str:
    rest = source[len(prefix):].split(".", 1)
    return prefix + str(k) + ("." + rest[1] if len(rest) > 1 else "")


def repeat_layers(graph: Graph, model: torch.nn.Module, container: str) -> Graph | None:
    """The graph of the KEEP-layer export with layer KEEP-1 repeated up to the model's layer count,
    or None when the layers are not provably copies of one another."""
    n = _text_config(model).num_hidden_layers
    src_prefix = container + "."  # node sources are the HF model's module paths
    wprefix = container.replace(".", "_") + "_"  # parameter names: the HF fqn with dots as underscores
    layer_of = [_layer_of(str(nd.meta.get("source", "")), src_prefix) for nd in graph.nodes]
    seen = [k for k in layer_of if k is not None]
    if sorted(seen) != seen or set(seen) != set(range(KEEP)):
        return None  # layers interleaved or missing: not a plain layer stack
    first = layer_of.index(0)
    last = len(layer_of) - 1 - layer_of[::-1].index(KEEP - 1)
    if any(k is None for k in layer_of[first:last + 1]):
        return None  # a top-level node between layers
    post = graph.nodes[last + 1:]
    layers = [[nd for nd, k in zip(graph.nodes, layer_of) if k == i] for i in range(KEEP)]
    where: dict[str, tuple[int, int, int]] = {}  # value -> (layer, node position, output index)
    for i, nodes in enumerate(layers):
        for j, nd in enumerate(nodes):
            for o, v in enumerate(nd.outputs):
                where[v.name] = (i, j, o)
    params = graph.params

    def param_for(name: str, i: int, k: int) -> str | None:
        """Layer i's parameter ``name`` as layer k's (None: not a per-layer parameter)."""
        p = f"{wprefix}{i}_"
        return f"{wprefix}{k}_" + name[len(p):] if name.startswith(p) else None

    if not _same_program(layers[1], layers[2], where, params, param_for, src_prefix):
        return None
    if any(where.get(v, (KEEP - 1,))[0] != KEEP - 1 for nd in post for v in nd.inputs if v in where):
        return None  # the head reads an earlier layer (all hidden states): not repeated
    state = {name.replace(".", "_"): t for name, t in model.state_dict(keep_vars=True).items()}
    out = graph.copy()
    names: dict[tuple[int, int, int], str] = {pos: v for v, pos in where.items()}
    new_nodes: list[Node] = list(out.nodes[:last + 1])
    for k in range(KEEP, n):
        for j, nd in enumerate(layers[KEEP - 1]):
            inputs: list[str | None] = []
            for v in nd.inputs:
                if v in where:
                    i, jj, o = where[v]
                    inputs.append(names[(k - (KEEP - 1 - i), jj, o)])
                elif v is not None and v in params and param_for(v, KEEP - 1, k) is not None:
                    p = param_for(v, KEEP - 1, k)
                    t = _layer_tensor(state, graph, v, p)
                    if t is None or tuple(t.shape) != tuple(params[v].shape) or t.dtype != graph.weights[v].dtype:
                        return None  # a tensor the rewrites made per layer, or not the model's own
                    if p not in out.params:
                        out.params[p] = params[v]
                        out.weights[p] = t
                    inputs.append(p)
                else:
                    inputs.append(v)
            outs = []
            for o, v in enumerate(nd.outputs):
                name = f"{v.name}__rep{k}"
                names[(k, j, o)] = name
                outs.append(Value(name, v.type))
            meta = dict(nd.meta)
            meta["source"] = _with_layer(str(nd.meta["source"]), src_prefix, k)
            new_nodes.append(Node(f"{nd.name}__rep{k}", nd.op, inputs, outs, dict(nd.attrs), meta))
    shift = {v: names[(n - 1, j, o)] for v, (i, j, o) in where.items() if i == KEEP - 1}
    for nd in post:
        new_nodes.append(nd.clone(inputs=[shift.get(v, v) if v is not None else None for v in nd.inputs]))
    out.nodes = new_nodes
    out.outputs = [shift.get(v, v) for v in out.outputs]
    # parameters in the order a whole-model export lists them: the module's own, then rewrite-made ones
    order = {name.replace(".", "_"): i for i, (name, _) in enumerate(model.named_parameters(remove_duplicate=False))}
    pos = {p: i for i, p in enumerate(out.params)}
    ranked = sorted(out.params, key=lambda p: (order.get(p, len(order)), pos[p] if p not in order else 0))
    out.params = {p: out.params[p] for p in ranked}
    for i, nd in enumerate(x for x in out.nodes if x.op in ("attention", "mla_attention")):
        if "layer" in nd.attrs:
            nd.attrs["layer"] = i
    from portlayer.flatten.naming import rename_from_source

    out = rename_from_source(out)
    out.meta["layers_repeated"] = {"exported": KEEP, "layers": n, "container": container}
    return out


def _layer_tensor(state: dict[str, torch.Tensor], graph: Graph, v: str, p: str) -> torch.Tensor | None:
    """Layer k's tensor ``p`` for layer 2's parameter ``v``: the module's own, or (GPT-2's Conv1D,
    stored transposed by the converter as ``<name>_t``) its transpose, checked on layer 2 first."""
    if p in state:
        return state[p].detach()
    if p.endswith("_t") and p[:-2] in state and v[:-2] in state:
        if torch.equal(graph.weights[v], state[v[:-2]].detach().t()):
            return state[p[:-2]].detach().t().contiguous()
    return None


def _same_program(a: list[Node], b: list[Node], where: dict[str, tuple[int, int, int]], params: dict,
                  param_for: Any, src_prefix: str) -> bool:
    """Layer 2 (b) computes what layer 1 (a) does, one layer on: same ops, attrs and types; inputs
    that are the corresponding values, the corresponding layer's parameters, or the same shared value."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.op != y.op or [v.type for v in x.outputs] != [v.type for v in y.outputs] or len(x.inputs) != len(y.inputs):
            return False
        if {k: v for k, v in x.attrs.items() if k != "layer"} != {k: v for k, v in y.attrs.items() if k != "layer"}:
            return False
        sx, sy = str(x.meta.get("source", "")), str(y.meta.get("source", ""))
        if _with_layer(sx, src_prefix, 2) != sy:
            return False
        for u, v in zip(x.inputs, y.inputs):
            if u in where or v in where:
                if u not in where or v not in where:
                    return False
                (iu, ju, ou), (iv, jv, ov) = where[u], where[v]
                if (iv - iu, jv, ov) != (1, ju, ou):
                    return False
            elif u is not None and u in params and param_for(u, 1, 2) is not None:
                if param_for(u, 1, 2) != v or params[u] != params.get(v):
                    return False
            elif u != v or (v is not None and param_for(v, 2, 2) is not None):
                return False
    return True
