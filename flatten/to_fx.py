"""Flat IR -> a torch module (and torch.export program) of its reference semantics.

For exporters that start from torch (torch-mlir's FX importer): ``forward(input_ids, positions)``
runs every node's reference implementation for one sequence, the full-sequence forward without a
KV cache. ``attention`` attends over the sequence itself (positions 0..T-1, its causal / window /
softcap attributes kept); ``pooling`` pools the one sequence. The output is what the graph returns:
logits [T, vocab] for a causal LM, hidden states [T, H] for an encoder, [1, H] when pooled.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from portlayer.flatten.ir import Graph
from portlayer.flatten.ops import get_op

TOKENS = "num_tokens"


def _eval(tree: tuple, b: dict[str, Any]) -> Any:
    """A parsed dim (flatten/dims.py tree) over symbolic ints, without int(): torch.export keeps it dynamic."""
    k = tree[0]
    if k == "int":
        return tree[1]
    if k == "sym":
        return b[tree[1]]
    if k == "neg":
        return -_eval(tree[1], b)
    if k == "pow":
        return _eval(tree[1], b) ** tree[2]
    if k == "call":
        args = [_eval(a, b) for a in tree[2]]
        name = tree[1]
        if name in ("Max", "Min"):
            out = args[0]
            for a in args[1:]:
                out = torch.sym_max(out, a) if name == "Max" else torch.sym_min(out, a)
            return out
        if name in ("FloorDiv",):
            return args[0] // args[1]
        if name in ("Mod", "PythonMod"):
            return args[0] % args[1]
        if name in ("floor", "ceiling", "CeilToInt", "FloorToInt"):
            return args[0]
        raise ValueError(f"to_fx: dim function {name} is not supported")
    x, y = _eval(tree[1], b), _eval(tree[2], b)
    return {"add": lambda: x + y, "sub": lambda: x - y, "mul": lambda: x * y, "div": lambda: x // y,
            "floordiv": lambda: x // y, "mod": lambda: x % y}[k]()


def _dim(d: Any, b: dict[str, Any]) -> Any:
    from portlayer.flatten.dims import parse_tree

    if isinstance(d, int) or d is None:
        return d
    return b[d] if d in b else _eval(parse_tree(str(d)), b)


def _context_op(op: str, args: list, attrs: dict[str, Any], b: dict[str, Any]) -> torch.Tensor | None:
    """The ops whose attributes hold symbolic dims, evaluated on the traced sizes."""
    from portlayer.flatten.ir import torch_dtype

    if op == "reshape":
        return args[0].reshape([_dim(d, b) for d in attrs["shape"]])
    if op == "expand":
        return args[0].expand(*[_dim(d, b) for d in attrs["shape"]])
    if op == "slice":
        idx = [slice(None)] * args[0].dim()
        idx[attrs["dim"]] = slice(attrs["start"], _dim(attrs["end"], b), attrs["step"])
        return args[0][tuple(idx)]
    if op == "full":
        return torch.full([_dim(d, b) for d in attrs["shape"]], attrs["value"], dtype=torch_dtype(attrs["dtype"]))
    if op == "arange":
        return torch.arange(attrs["start"], _dim(attrs["end"], b), attrs["step"], dtype=torch_dtype(attrs["dtype"]))
    return None


class _Ctx:
    """What context-needing reference ops read: symbol bindings only (no metadata, no cache)."""

    def __init__(self, bindings: dict[str, Any]) -> None:
        self.bindings = bindings
        self.attn_metadata = None
        self.kv_cache = None
        self.device = "cpu"


def _buffer_name(name: str) -> str:
    return "w_" + re.sub(r"\W", "_", name)


class FlatModule(torch.nn.Module):
    """forward(input_ids [T], positions [T]) -> the graph's outputs, by the reference semantics."""

    def __init__(self, graph: Graph) -> None:
        super().__init__()
        bad = [v.name for v in graph.inputs if v.name not in ("input_ids", "positions")]
        if bad:
            raise ValueError(f"to_fx: graph inputs {bad} are not the token stream (input_ids, positions)")
        self.graph_ir = graph
        self._buffers_of = {}
        for name, t in graph.weights.items():
            if name in graph.params:
                self.register_buffer(_buffer_name(name), t.detach().clone())
                self._buffers_of[name] = _buffer_name(name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        from portlayer.flatten.op_defs.attention import attention_reference

        g = self.graph_ir
        env: dict[str, torch.Tensor] = {k: getattr(self, b) for k, b in self._buffers_of.items()}
        env["input_ids"], env["positions"] = input_ids, positions
        ctx = _Ctx({TOKENS: input_ids.shape[0], "num_seqs": 1})
        for n in g.nodes:
            args = [env[i] if i is not None else None for i in n.inputs]
            if n.op == "attention":
                q, k, v = args
                a = n.attrs
                scale = a["scale"] if a.get("scale") is not None else 1.0 / math.sqrt(q.shape[-1])
                outs = [attention_reference(q, k, v, scale=scale, causal=bool(a["causal"]),
                                            sliding_window=a.get("sliding_window"), softcap=a.get("softcap"),
                                            q_pos=torch.arange(q.shape[0], device=q.device))]
            elif (r := _context_op(n.op, args, n.attrs, ctx.bindings)) is not None:
                outs = [r]
            else:
                outs = get_op(n.op).reference(args, n.attrs, ctx)
            for val, t in zip(n.outputs, outs):
                env[val.name] = t
        res = tuple(env[o] for o in g.outputs)
        return res[0] if len(res) == 1 else res


def example_inputs(graph: Graph, tokens: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = int(graph.meta.get("vocab_size") or 100)
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (tokens,), generator=gen), torch.arange(tokens)


def to_exported_program(graph: Graph, *, dynamic: bool = True, tokens: int = 7) -> torch.export.ExportedProgram:
    """torch.export of FlatModule with a dynamic token count (1 .. the model's max positions)."""
    module = FlatModule(graph).eval()
    ids, pos = example_inputs(graph, tokens)
    shapes = None
    if dynamic:
        t = torch.export.Dim(TOKENS, min=1, max=int(graph.meta.get("max_positions") or 4096))
        shapes = {"input_ids": {0: t}, "positions": {0: t}}
    with torch.no_grad():
        return torch.export.export(module, (ids, pos), dynamic_shapes=shapes, strict=False)
