"""The one interface the runtime calls: run a compiled program on one step's token stream."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from portlayer.flatten.ir import Graph
from portlayer.flatten.op_defs.attention import AttentionMetadata


@runtime_checkable
class Executable(Protocol):
    device: torch.device
    dtype: torch.dtype
    #: graph inputs the program reads; "logits_indices" among them means the program
    #: computes logits only for those stream rows (flatten/logits.py)
    input_names: tuple[str, ...]

    def run(
        self,
        feeds: Mapping[str, torch.Tensor],
        attn_metadata: AttentionMetadata | None,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> list[torch.Tensor]: ...


class ReferenceExecutable:
    """Runs a graph with each op's reference torch implementation (the semantics)."""

    def __init__(self, graph: Graph, device: torch.device | str = "cpu") -> None:
        from portlayer.flatten.ir import torch_dtype

        self.graph = graph
        self.input_names = tuple(v.name for v in graph.inputs)
        self.device = torch.device(device)
        floats = [t.dtype for t in graph.params.values() if t.dtype.startswith(("float", "bfloat"))]
        self.dtype = torch_dtype(floats[0]) if floats else torch.float32
        # on the CPU the graph's own weights (a lazy one is made per node as it runs, not all at once)
        self.weights = graph.weights if self.device.type == "cpu" else {k: v.to(self.device) for k, v in graph.weights.items()}

    def run(self, feeds, attn_metadata, kv_caches) -> list[torch.Tensor]:
        from portlayer.flatten.interpret import ExecContext, bind_symbols, run_graph

        ctx = ExecContext(bindings=bind_symbols(self.graph, feeds), attn_metadata=attn_metadata,
                          kv_cache=kv_caches, device=self.device)
        return run_graph(self.graph, feeds, ctx, weights=self.weights)
