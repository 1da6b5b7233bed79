"""ExportedProgram -> Flat IR: one table mapping aten ops to portable ops.

Shapes come from each FX node's fake value, so view-like ops become ``reshape`` to the
recorded output shape (symbolic dims included) instead of re-deriving torch's argument
conventions. An op with no entry in the table raises :class:`UnsupportedOpError` naming
the aten op, its FX node and the HF module it came from.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram

from portlayer.errors import PortlayerError
from portlayer.flatten.ir import Dim, Graph, GraphBuilder, TensorType, dtype_name, normalize_dim

aten = torch.ops.aten


class UnsupportedOpError(PortlayerError, NotImplementedError):
    """An aten op has no mapping to the portable op registry."""


@dataclass(frozen=True)
class Sym:
    """A symbolic integer flowing through the FX graph (e.g. a sym_size result)."""

    dim: Dim


Handler = Callable[["Converter", torch.fx.Node, list[Any], dict[str, Any]], Any]
_TABLE: dict[Any, Handler] = {}


def lower(*targets: Any) -> Callable[[Handler], Handler]:
    """Register a handler for aten overloads or overload packets."""

    def deco(fn: Handler) -> Handler:
        for t in targets:
            _TABLE[t] = fn
        return fn

    return deco


def module_path(node: torch.fx.Node) -> str:
    """The innermost HF module an FX node came from, e.g. ``model.layers.3.self_attn``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<top level>"
    path = list(stack.values())[-1][0]
    path = path.removeprefix("L['self'].").removeprefix("L__self___")
    return path.removeprefix("model.", ) if path.startswith("model.") else path


class Converter:
    """Walks the exported FX graph once, emitting Flat IR through a GraphBuilder."""

    def __init__(self, ep: ExportedProgram, token_symbol: str) -> None:
        self.ep = ep
        self.b = GraphBuilder(Graph())
        self.env: dict[str, Any] = {}
        self.token_symbol = token_symbol
        self.sym_names: dict[str, str] = {}
        self.current: torch.fx.Node | None = None
        self._transposed: dict[str, str] = {}
        self.transposes: dict[str, str] = {}  # value -> the 2-D parameter it is the transpose of (x @ W.T is linear)

    # ---- helpers used by handlers ---------------------------------------------------------
    def dim(self, d: Any) -> Dim:
        if isinstance(d, Sym):
            return d.dim
        if isinstance(d, torch.fx.Node):
            return self.dim(self.env[d.name])
        if isinstance(d, torch.SymInt):
            expr = str(d.node.expr)
            for k, v in self.sym_names.items():
                expr = _replace_symbol(expr, k, v)
            return normalize_dim(expr)
        return normalize_dim(int(d))

    def out_shape(self, node: torch.fx.Node | None = None, index: int | None = None) -> tuple[Dim, ...]:
        val = (node or self.current).meta["val"]
        if index is not None:
            val = val[index]
        return tuple(self.dim(s) for s in val.shape)

    def out_dtype(self, node: torch.fx.Node | None = None) -> str:
        val = (node or self.current).meta["val"]
        return dtype_name(val.dtype)

    def type_of(self, value: str) -> TensorType:
        return self.b.types[value]

    def emit(self, op: str, inputs: list[str | None], attrs: dict[str, Any] | None = None, name: str | None = None) -> str:
        meta = {"source": module_path(self.current), "fx_node": self.current.name} if self.current is not None else {}
        return self.b.add1(op, inputs, attrs, name=name or self.current.name, meta=meta)

    def emit_multi(self, op: str, inputs: list[str | None], attrs: dict[str, Any] | None = None) -> list[str]:
        meta = {"source": module_path(self.current), "fx_node": self.current.name}
        return self.b.add(op, inputs, attrs, name=self.current.name, meta=meta)

    def reshape_to(self, x: str, shape: tuple[Dim, ...]) -> str:
        if tuple(self.type_of(x).shape) == tuple(shape):
            return x
        return self.emit("reshape", [x], {"shape": list(shape)})

    def param_transposed(self, w: str) -> str:
        """A [N, K] parameter holding ``w.T`` for GEMMs written as x @ W (GPT-2's Conv1D)."""
        if w not in self._transposed:
            t = self.b.graph.weights[w].t().contiguous()
            self._transposed[w] = self.b.add_param(f"{w}_t", t)
        return self._transposed[w]

    def is_param(self, v: Any) -> bool:
        return isinstance(v, str) and v in self.b.graph.params

    # ---- the walk -----------------------------------------------------------------------------
    def run(self) -> Graph:
        sig = self.ep.graph_signature
        state = dict(self.ep.state_dict)
        state.update(getattr(self.ep, "constants", {}) or {})
        to_param = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
        user_inputs = list(sig.user_inputs)
        input_names = ["input_ids", "positions"]
        for node in self.ep.graph.nodes:
            self.current = node
            if node.op == "placeholder":
                if node.name in to_param:
                    fqn = to_param[node.name]
                    tensor = state[fqn]
                    self.env[node.name] = self.b.add_param(_param_name(fqn), tensor.detach())
                else:
                    k = user_inputs.index(node.name)
                    val = node.meta["val"]
                    for s in val.shape:
                        if isinstance(s, torch.SymInt) and str(s.node.expr) not in self.sym_names:
                            self.sym_names[str(s.node.expr)] = self.token_symbol
                    name = input_names[k] if k < len(input_names) else node.name
                    self.env[node.name] = self.b.add_input(
                        name, TensorType(dtype_name(val.dtype), self.out_shape(node))
                    )
            elif node.op == "call_function":
                self.env[node.name] = self._call(node)
            elif node.op == "output":
                outs = node.args[0]
                outs = outs if isinstance(outs, (list, tuple)) else [outs]
                for o in outs:
                    v = self.env[o.name] if isinstance(o, torch.fx.Node) else None
                    if not isinstance(v, str):
                        raise UnsupportedOpError(f"graph output {o} is not a tensor value")
                    self.b.graph.outputs.append(v)
            else:
                raise UnsupportedOpError(f"FX node {node.name}: unexpected node kind {node.op!r}")
        self.current = None
        g = self.b.graph
        _renumber_attention_layers(g)
        return g

    def _call(self, node: torch.fx.Node) -> Any:
        from portlayer.flatten.from_export_inplace import convert_mutation, mutates

        if mutates(node):
            return convert_mutation(self, node)
        from portlayer.flatten.from_export_complex import convert_complex, is_complex

        args = [self._resolve(a) for a in node.args]
        kwargs = {k: self._resolve(v) for k, v in node.kwargs.items()}
        if is_complex(args) or is_complex(list(kwargs.values())):
            return convert_complex(self, node, args, kwargs)
        target = node.target
        handler = _TABLE.get(target)
        if handler is None and hasattr(target, "overloadpacket"):
            handler = _TABLE.get(target.overloadpacket)
        if handler is None:
            raise UnsupportedOpError(
                f"aten op {target} (FX node '{node.name}', from HF module '{module_path(node)}') has no "
                "mapping to a portable op. Add a @lower handler in portlayer/flatten/from_export_table.py or from_export_compute.py "
                "(or register a new op in flatten/op_defs/) and a test."
            )
        return handler(self, node, args, kwargs)

    def _resolve(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return self.env[a.name]
        if isinstance(a, (list, tuple)):
            return type(a)(self._resolve(x) for x in a)
        return a


def _replace_symbol(expr: str, old: str, new: str) -> str:
    import re

    return re.sub(rf"\b{re.escape(old)}\b", new, expr)


def _param_name(fqn: str) -> str:
    name = fqn.removeprefix("model.") if fqn.startswith("model.") else fqn
    return name.replace(".", "_")


def _renumber_attention_layers(g: Graph) -> None:
    """KV-cache layer = order of the attention node in the graph (one cache per node)."""
    for i, n in enumerate(n for n in g.nodes if n.op == "attention"):
        n.attrs["layer"] = i


def convert_exported_program(ep: ExportedProgram, token_symbol: str = "num_tokens") -> Graph:
    """Convert an ExportedProgram (pre-decomposition ATen) into a Flat IR Graph."""
    from portlayer.flatten import (  # noqa: F401  (fill _TABLE)
        from_export_complex,
        from_export_compute,
        from_export_inplace,
        from_export_moe,
        from_export_table,
    )

    return Converter(functionalized(ep), token_symbol).run()


def functionalized(ep: ExportedProgram) -> ExportedProgram:
    """In-place ops (``x /= s``, ``copy_`` into a view of a fresh tensor, ``scatter_``) made pure.

    The op-by-op table maps values, not storage. Mutations of fresh tensors (and of one slice
    of one) that no earlier view still reads are converted in place by the converter
    (from_export_inplace.convert_mutation); anything else is rewritten by torch.export's own
    functionalization (run_decompositions with an empty table: no op is decomposed), which
    costs a second trace.
    """
    from portlayer.flatten.from_export_inplace import directly_convertible

    if directly_convertible(ep.graph):
        return ep
    return ep.run_decompositions({})


__all__ = ["Converter", "Sym", "UnsupportedOpError", "convert_exported_program", "lower", "module_path", "operator"]
