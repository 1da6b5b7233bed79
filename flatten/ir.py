"""The Flat Model IR: a linear list of nodes over single-assignment values.

Construction and queries only; printing, serialisation, verification and execution
live in their own modules. Shapes may hold symbolic dimensions: a dimension is an
``int`` or a string holding an expression in the dim grammar of flatten/dims.py over
symbols such as ``num_tokens`` (e.g. ``"num_tokens"`` or ``"2*num_tokens"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from portlayer.flatten import dims

Dim = int | str

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,  # KV cache elements (Plan kv_cache_dtype)
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical dtype string ('float32', 'int64', ...) for a torch dtype or a name."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} is not representable in the Flat IR; known: {sorted(DTYPES)}")
    return DTYPE_NAMES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[dtype_name(name)]


def dtype_itemsize(name: str) -> int:
    return torch.empty((), dtype=torch_dtype(name)).element_size()


@dataclass(frozen=True)
class TensorType:
    """dtype and shape of a value; dims are ints or symbolic expressions (strings)."""

    dtype: str
    shape: tuple[Dim, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "shape", tuple(normalize_dim(d) for d in self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    def numel(self, bindings: Mapping[str, int] | None = None) -> int:
        n = 1
        for d in self.shape:
            n *= eval_dim(d, bindings or {})
        return n

    def nbytes(self, bindings: Mapping[str, int] | None = None) -> int:
        return self.numel(bindings) * dtype_itemsize(self.dtype)

    def concrete(self, bindings: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(eval_dim(d, bindings) for d in self.shape)

    def with_shape(self, shape: Sequence[Dim]) -> TensorType:
        return TensorType(self.dtype, tuple(shape))

    def with_dtype(self, dtype: str) -> TensorType:
        return TensorType(dtype, self.shape)

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape)}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> TensorType:
        return TensorType(d["dtype"], tuple(d["shape"]))


def to_sympy(d: Any):  # -> sympy.Expr
    """A dim as a sympy expression whose symbols are positive integers (sizes are).

    Strings are read by the strict dim grammar (flatten/dims.py), never by sympify.
    """
    import sympy

    if isinstance(d, bool):
        raise TypeError(f"a dimension cannot be a bool: {d!r}")
    if isinstance(d, int):
        return sympy.Integer(d)
    return dims.parse_dim(str(d))


def normalize_dim(d: Any) -> Dim:
    """Ints stay ints; symbolic expressions become canonical strings (constants fold to int)."""
    if isinstance(d, bool):
        raise TypeError(f"a dimension cannot be a bool: {d!r}")
    if isinstance(d, int):
        return d
    if isinstance(d, torch.SymInt):
        d = str(d.node.expr)
    elif not isinstance(d, str):
        if type(d).__module__.split(".")[0] != "sympy":
            raise dims.DimError(f"dimension {d!r} is a {type(d).__name__}, not an int or a string")
        d = str(d)
    return dims.canonical_dim(d)


def eval_dim(d: Dim, bindings: Mapping[str, int]) -> int:
    """Evaluate a dimension under symbol bindings; raises naming the unbound symbols.

    Hot in the reference executable (every reshape), so a bare symbol is a dict lookup and
    expressions are parsed once (strict grammar) and evaluated exactly from their tree.
    """
    if isinstance(d, int):
        return d
    if d in bindings:
        return int(bindings[d])
    return dims.evaluate_dim(d, bindings)


def dim_symbols(d: Dim) -> set[str]:
    if isinstance(d, int):
        return set()
    return set(dims.dim_names(d))


@dataclass(frozen=True)
class Value:
    """A named SSA value with its tensor type."""

    name: str
    type: TensorType

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **self.type.to_json()}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Value:
        return Value(d["name"], TensorType(d["dtype"], tuple(d["shape"])))


@dataclass
class Node:
    """One operation: op name from the portable registry, input value names, output values.

    ``inputs`` may hold ``None`` for an absent optional input. ``attrs`` are JSON-able op
    attributes; ``meta`` holds provenance and pass annotations (source module, selected
    implementation, kernel group) and is JSON-able too.
    """

    name: str
    op: str
    inputs: list[str | None]
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def output(self) -> Value:
        if len(self.outputs) != 1:
            raise ValueError(f"node {self.name} ({self.op}) has {len(self.outputs)} outputs, not one")
        return self.outputs[0]

    def clone(self, **changes: Any) -> Node:
        base = dataclasses.replace(
            self,
            inputs=list(self.inputs),
            outputs=list(self.outputs),
            attrs=dict(self.attrs),
            meta=dict(self.meta),
        )
        for k, v in changes.items():
            setattr(base, k, v)
        return base

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "op": self.op,
            "inputs": list(self.inputs),
            "outputs": [v.to_json() for v in self.outputs],
            "attrs": self.attrs,
        }
        if self.meta:
            d["meta"] = self.meta
        return d

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Node:
        return Node(
            name=d["name"],
            op=d["op"],
            inputs=list(d["inputs"]),
            outputs=[Value.from_json(v) for v in d["outputs"]],
            attrs=dict(d.get("attrs", {})),
            meta=dict(d.get("meta", {})),
        )


@dataclass
class Graph:
    """An ordered, single-assignment operator list with inputs, parameters and outputs.

    ``params`` maps parameter names to their types; ``weights`` holds the tensors for
    them (kept beside the graph, saved as safetensors, never pickled). ``meta`` carries
    model-level facts (architecture, config values, the token symbol, pooling).
    """

    inputs: list[Value] = field(default_factory=list)
    params: dict[str, TensorType] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    meta: dict[str, Any] = field(default_factory=dict)

    # ---- queries -------------------------------------------------------------------
    def value_types(self) -> dict[str, TensorType]:
        """Every value name (inputs, params, node outputs) mapped to its type."""
        types: dict[str, TensorType] = {v.name: v.type for v in self.inputs}
        types.update(self.params)
        for n in self.nodes:
            for v in n.outputs:
                types[v.name] = v.type
        return types

    def producers(self) -> dict[str, Node]:
        return {v.name: n for n in self.nodes for v in n.outputs}

    def users(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i is not None:
                    out.setdefault(i, []).append(n)
        return out

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r} in graph")

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return dict(sorted(counts.items()))

    def find(self, op: str) -> list[Node]:
        return [n for n in self.nodes if n.op == op]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def copy(self) -> Graph:
        """A structural copy (nodes cloned; weight tensors shared, never mutated in place)."""
        return Graph(
            inputs=list(self.inputs),
            params=dict(self.params),
            nodes=[n.clone() for n in self.nodes],
            outputs=list(self.outputs),
            weights=self.weights.copy(),  # a WeightStore stays lazy (flatten/weights_stream.py)
            meta=dict(self.meta),
        )

    def to_networkx(self):  # -> networkx.DiGraph
        """Dataflow DiGraph: one vertex per node (and per input/param), edges along values."""
        import networkx as nx

        g = nx.DiGraph()
        prod: dict[str, str] = {}
        for v in self.inputs:
            g.add_node(v.name, kind="input", type=str(v.type))
            prod[v.name] = v.name
        for name, t in self.params.items():
            g.add_node(name, kind="param", type=str(t))
            prod[name] = name
        for n in self.nodes:
            g.add_node(n.name, kind="node", op=n.op)
            for v in n.outputs:
                prod[v.name] = n.name
            for i in n.inputs:
                if i is not None and i in prod:
                    g.add_edge(prod[i], n.name, value=i)
        for o in self.outputs:
            g.add_node(f"output:{o}", kind="output")
            if o in prod:
                g.add_edge(prod[o], f"output:{o}", value=o)
        return g

    def _repr_html_(self) -> str:
        from portlayer.flatten.notebook import graph_html

        return graph_html(self)

    def __str__(self) -> str:
        from portlayer.flatten.printer import print_graph

        return print_graph(self)


class GraphBuilder:
    """Appends nodes with fresh, unique names and types inferred by the op registry."""

    def __init__(self, graph: Graph | None = None) -> None:
        self.graph = graph if graph is not None else Graph()
        self.types: dict[str, TensorType] = self.graph.value_types()
        self._names: set[str] = set(self.types) | {n.name for n in self.graph.nodes}
        self._counter: dict[str, int] = {}

    def fresh(self, base: str) -> str:
        base = "".join(c if (c.isalnum() or c == "_") else "_" for c in base) or "v"
        if base[0].isdigit():
            base = "v" + base
        if base not in self._names:
            self._names.add(base)
            return base
        k = self._counter.get(base, 1)
        while f"{base}_{k}" in self._names:
            k += 1
        self._counter[base] = k + 1
        name = f"{base}_{k}"
        self._names.add(name)
        return name

    def add_input(self, name: str, type: TensorType) -> str:
        name = self.fresh(name)
        self.graph.inputs.append(Value(name, type))
        self.types[name] = type
        return name

    def add_param(self, name: str, tensor: torch.Tensor) -> str:
        name = self.fresh(name)
        self.graph.params[name] = TensorType(dtype_name(tensor.dtype), tuple(tensor.shape))
        self.graph.weights[name] = tensor
        self.types[name] = self.graph.params[name]
        return name

    def add(
        self,
        op: str,
        inputs: Sequence[str | None],
        attrs: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
        meta: Mapping[str, Any] | None = None,
        types: Mapping[str, TensorType] | None = None,
    ) -> list[str]:
        """Append ``op`` and return its output value names; types come from the op's inference."""
        from portlayer.flatten.ops import get_op

        opdef = get_op(op)
        attrs = opdef.complete_attrs(dict(attrs or {}))
        known = types if types is not None else self.types
        in_types = [known[i] if i is not None else None for i in inputs]
        out_types = opdef.infer(in_types, attrs)
        node_name = self.fresh(name or op)
        outs = [
            Value(node_name if k == 0 else self.fresh(f"{node_name}_{k}"), t) for k, t in enumerate(out_types)
        ]
        self.graph.nodes.append(Node(node_name, op, list(inputs), outs, dict(attrs), dict(meta or {})))
        for v in outs:
            self.types[v.name] = v.type
        return [v.name for v in outs]

    def add1(self, op: str, inputs: Sequence[str | None], attrs: Mapping[str, Any] | None = None, **kw: Any) -> str:
        outs = self.add(op, inputs, attrs, **kw)
        if len(outs) != 1:
            raise ValueError(f"op {op} has {len(outs)} outputs; use add()")
        return outs[0]
