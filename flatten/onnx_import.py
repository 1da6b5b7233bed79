"""ONNX ModelProto -> Flat IR: one walk over the nodes through the ONNX-op table (onnx_table.py).

Each ONNX value becomes one of three things during the walk: a Flat IR value (a tensor
computed at run time), a numpy constant (initializers, Constant nodes, anything computed
from constants only, folded with onnx's own reference evaluator), or a shape vector
(:class:`SymInts`, the int64 tensors exporters build from ``Shape`` to feed Reshape / Expand /
Range, carried as symbolic dims). Dynamic axes (``dim_param``) become symbols of the dims
grammar. The result is *faithful*: the ONNX inputs and outputs, batch axis and attention mask
included; flatten/onnx_stream.py turns it into the flat token stream that compile serves.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from portlayer.flatten.ir import Dim, Graph, GraphBuilder, TensorType, normalize_dim
from portlayer.flatten.onnx_load import OnnxImportError, default_opset, load_onnx

#: ONNX TensorProto element types the Flat IR can hold
ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
               11: "float64", 16: "bfloat16"}


class UnmappedOnnxOpError(OnnxImportError):
    """An ONNX op (or an op form) with no mapping to the portable op registry."""


@dataclass(frozen=True)
class SymInts:
    """An int64 shape vector (or scalar, ``scalar=True``) whose entries may be symbolic dims."""

    dims: tuple[Dim, ...]
    scalar: bool = False

    def const(self) -> np.ndarray | None:
        if all(isinstance(d, int) for d in self.dims):
            a = np.array(self.dims, dtype=np.int64)
            return a.reshape(()) if self.scalar else a
        return None


Handler = Callable[["OnnxConverter", Any, list[Any], dict[str, Any]], list[Any]]
_TABLE: dict[str, Handler] = {}


def onnx_op(*op_types: str) -> Callable[[Handler], Handler]:
    """Register a handler for ONNX op types (default domain)."""

    def deco(fn: Handler) -> Handler:
        for t in op_types:
            if t in _TABLE:
                raise ValueError(f"ONNX op {t!r} is registered twice")
            _TABLE[t] = fn
        return fn

    return deco


def mapped_ops() -> list[str]:
    """The ONNX op types the import table maps (for docs and the node-test report)."""
    _fill()
    return sorted(_TABLE)


def _fill() -> None:
    from portlayer.flatten import onnx_table, onnx_table_index, onnx_table_shape  # noqa: F401  (fill _TABLE)


def sym_name(name: str) -> str:
    """An ONNX dim_param as a dims-grammar symbol ('batch_size', 'sequence_length', 's0')."""
    s = re.sub(r"\W", "_", name).strip("_") or "dim"
    return s if not s[0].isdigit() else f"d_{s}"


class OnnxConverter:
    """State of one import: the builder, the value environment and the node being converted."""

    def __init__(self, model: Any, where: str) -> None:
        self.model = model
        self.where = where
        self.opset = default_opset(model)
        self.b = GraphBuilder(Graph())
        self.env: dict[str, Any] = {}
        self.node: Any = None
        self.position = 0
        self._params: dict[int, str] = {}
        self._arrays: list[np.ndarray] = []
        self._const_names: dict[int, str] = {}
        self._anon = 0
        self._source = "<top level>"

    # ---- helpers used by handlers ---------------------------------------------------------
    def fail(self, why: str) -> UnmappedOnnxOpError:
        n = self.node
        return UnmappedOnnxOpError(
            f"{self.where}: ONNX node {self.position} ({n.op_type} '{n.name or '<unnamed>'}', opset {self.opset}): {why}")

    def type_of(self, v: str) -> TensorType:
        return self.b.types[v]

    def emit(self, op: str, inputs: list[str | None], attrs: dict[str, Any] | None = None) -> str:
        name = _py_name(self.node.name or self.node.op_type)
        meta = {"source": self._source, "onnx_node": f"{self.position}:{self.node.name or self.node.op_type}"}
        return self.b.add1(op, inputs, attrs, name=name, meta=meta)

    def tensor(self, v: Any) -> str:
        """A Flat IR value for ``v``: constants become parameters (each array once)."""
        if isinstance(v, str):
            return v
        if isinstance(v, SymInts):
            c = v.const()
            if c is None:
                return self._materialize(v)
            v = c
        if isinstance(v, np.ndarray):
            key = id(v)
            if key not in self._params:
                self._anon += 1
                name = self._const_names.get(key) or f"onnx_const_{self._anon}"
                self._params[key] = self.param(v, name)
                self._arrays.append(v)  # id() stays unique while the array lives
            return self._params[key]
        raise self.fail(f"input of unexpected kind {type(v).__name__}")

    def _materialize(self, v: SymInts) -> str:
        """A symbolic shape vector as run-time int64 data: each symbolic entry d is sum(full([d], 1))."""
        parts = []
        for d in v.dims:
            if isinstance(d, int):
                parts.append(self.emit("full", [], {"shape": [1], "value": d, "dtype": "int64"}))
            else:
                ones = self.emit("full", [], {"shape": [d], "value": 1, "dtype": "int64"})
                parts.append(self.emit("sum", [ones], {"dims": [0], "keepdim": True}))
        out = parts[0] if len(parts) == 1 else self.emit("concat", parts, {"dim": 0})
        return self.reshape_to(out, []) if v.scalar else out

    def param(self, v: np.ndarray, name: str) -> str:
        return self.b.add_param(_py_name(name), torch.from_numpy(np.array(v, copy=True, order="C")))  # keeps 0-d

    def reshape_to(self, x: str, shape: list[Dim]) -> str:
        if list(self.type_of(x).shape) == list(shape):
            return x
        return self.emit("reshape", [x], {"shape": list(shape)})

    # ---- the walk -------------------------------------------------------------------------------
    def run(self) -> Graph:
        import onnx
        from onnx import numpy_helper

        _fill()
        g = self.model.graph
        init_names = set()
        for t in g.initializer:
            arr = numpy_helper.to_array(t)
            init_names.add(t.name)
            self.env[t.name] = arr
            self._arrays.append(arr)  # kept alive: parameters are cached by id()
            self._const_names[id(arr)] = t.name
        for vi in g.input:
            if vi.name in init_names:
                continue
            self.env[vi.name] = self.b.add_input(_py_name(vi.name), _value_type(vi, self.where))
        for i, node in enumerate(g.node):
            self.node, self.position = node, i
            self._source = module_path(node)
            if node.domain not in ("", "ai.onnx"):
                raise self.fail(f"custom domain {node.domain!r} is not supported")
            ins = [self.env[x] if x else None for x in node.input]
            for x, v in zip(node.input, ins):
                if x and v is None and x not in self.env:
                    raise self.fail(f"input {x!r} is produced by no earlier node")
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            if any(isinstance(a, onnx.GraphProto) for a in attrs.values()):
                raise self.fail("control flow (a subgraph attribute) is not supported")
            outs = self._convert(node, ins, attrs)
            for name, v in zip(node.output, outs):
                if name:
                    self.env[name] = v
        for vo in g.output:
            v = self.env[vo.name]
            if not isinstance(v, str) or v not in self.b.types:
                v = self.tensor(v)
            self.b.graph.outputs.append(v)
        out = self.b.graph
        out.meta.update({"source_format": "onnx", "source": self.where, "onnx_opset": self.opset})
        return out

    def _convert(self, node: Any, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
        consts = all(v is None or isinstance(v, np.ndarray) or (isinstance(v, SymInts) and v.const() is not None)
                     for v in ins)
        if consts and node.op_type not in _NO_FOLD:  # constants only: evaluated once, here, by onnx itself
            return fold_constant(node, [v.const() if isinstance(v, SymInts) else v for v in ins], self.opset)
        handler = _TABLE.get(node.op_type)
        if handler is None:
            raise self.fail(
                "this ONNX op has no mapping to a portable op. Add an @onnx_op handler in "
                "portlayer/flatten/onnx_table.py (or register a new op in flatten/op_defs/) and a node test.")
        return handler(self, node, ins, attrs)


#: ops never folded at import (their output is random or shaped by the run)
_NO_FOLD = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


def fold_constant(node: Any, ins: list[Any], opset: int) -> list[Any]:
    """Evaluate one node on constant inputs with onnx's reference evaluator."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    names = [f"in{i}" if x else "" for i, x in enumerate(node.input)]
    n2 = onnx.helper.make_node(node.op_type, names, [f"out{i}" for i in range(len(node.output))],
                               domain=node.domain)
    n2.attribute.extend(node.attribute)
    feeds = {nm: np.asarray(v) for nm, v in zip(names, ins) if nm}
    graph = onnx.helper.make_graph([n2], "fold", [onnx.helper.make_tensor_value_info(k, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in feeds.items()],
                                   [onnx.helper.make_empty_tensor_value_info(o) for o in n2.output])
    m = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    res = ReferenceEvaluator(m).run(None, feeds)
    return [np.asarray(r) for r in res]


def module_path(node: Any) -> str:
    """The torch module a node was exported from ('model.layers.0.self_attn'), for readable names.

    The dynamo exporter records ``pkg.torch.onnx.name_scopes`` (a list of scope names, read here as
    quoted strings, never evaluated); the TorchScript exporter names nodes '/model/layers.0/.../MatMul'.
    """
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            scopes = re.findall(r"'([^']*)'", p.value)
            if len(scopes) >= 2:
                return scopes[-2] or "<top level>"
    if node.name.startswith("/"):
        parts = [x for x in node.name.split("/") if x][:-1]
        return ".".join(parts) if parts else "<top level>"
    return "<top level>"


def _value_type(vi: Any, where: str) -> TensorType:
    tt = vi.type.tensor_type
    if tt.elem_type not in ONNX_DTYPES:
        raise OnnxImportError(f"{where}: graph input {vi.name!r} has ONNX element type {tt.elem_type}, which the Flat IR "
                              f"cannot hold (supported: {sorted(ONNX_DTYPES.values())})")
    if not tt.HasField("shape"):
        raise OnnxImportError(f"{where}: graph input {vi.name!r} has no shape; export with explicit input shapes")
    dims: list[Dim] = []
    for k, d in enumerate(tt.shape.dim):
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.dim_param:
            dims.append(normalize_dim(sym_name(d.dim_param)))
        else:
            dims.append(normalize_dim(f"{sym_name(vi.name)}_{k}"))
    return TensorType(ONNX_DTYPES[tt.elem_type], tuple(dims))


def _py_name(s: str) -> str:
    s = re.sub(r"\W", "_", s).strip("_") or "v"
    return s if not s[0].isdigit() else f"v{s}"


def import_onnx_faithful(model: Any, where: str = "<model>") -> Graph:
    """The ONNX graph as Flat IR with its own inputs and outputs (no token-stream rewrite)."""
    from portlayer.flatten.onnx_cleanup import cleanup

    return cleanup(OnnxConverter(model, where).run())


def import_onnx(path: str | Path, *, stream: bool = True, verify: bool = True) -> Graph:
    """Import an ONNX file. ``stream`` (default) rewrites it to the flat token stream
    (inputs ``input_ids``/``positions`` [num_tokens], one ``attention`` op per layer) so that
    compile, the runtime and the passes treat it like a captured HF model; ``verify`` then checks
    the stream graph against the faithful one on padded batches (flatten/onnx_stream.py)."""
    model = load_onnx(path)
    graph = import_onnx_faithful(model, str(path))
    if not stream:
        return graph
    from portlayer.flatten.onnx_stream import to_token_stream

    return to_token_stream(graph, verify=verify, where=str(path))
