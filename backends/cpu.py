"""The CPU adapter: host memory through torch, the reference and fallback target."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from portlayer.backends.base import BackendAdapter, MemoryInfo
from portlayer.backends.registry import register_backend

if TYPE_CHECKING:
    from portlayer.capabilities.probe import DetectedDevice


@register_backend("cpu")
class CPUAdapter(BackendAdapter):
    device_type = "cpu"
    codegen_family = "torch"
    torch_device_type = "cpu"

    @property
    def torch_device(self) -> str:
        return "cpu"

    @classmethod
    def probe(cls) -> list[DetectedDevice]:
        from portlayer.capabilities.probe import probe_devices

        return [d for d in probe_devices() if d.device_type == "cpu"]

    def query_memory_capacity(self) -> MemoryInfo:
        import os

        page = os.sysconf("SC_PAGE_SIZE")
        total = page * os.sysconf("SC_PHYS_PAGES")
        try:
            free = page * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError):
            free = total
        return MemoryInfo(total_bytes=total, free_bytes=free)

    def _raw_allocate(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        # Pinning needs an accelerator runtime; on a CPU-only host plain memory is the same thing.
        return torch.empty(nbytes, dtype=torch.uint8)

    def synchronize(self) -> None:
        """CPU torch ops are synchronous; nothing is queued."""

    def supports_graph_capture(self) -> bool:
        return False

    def launches_asynchronously(self) -> bool:
        return False  # nothing to overlap: a step is done when its launch returns

    def compile_program(self, result, out_dir) -> list:
        """The generated torch host program (reference-op calls in kernel order) for a PipelineResult."""
        from portlayer.backends.generate import generate
        from portlayer.codegen.program import write_program

        gen = generate(result.graph, getattr(result, "plan", None), getattr(result, "descriptor", None) or self.descriptor)
        return write_program(gen, out_dir)

    def load_program(self, artifact_dir, weights, plan=None, **options):
        """The Executable of a compiled artifact: its generated host program, run with torch on the CPU."""
        from portlayer.codegen.program import load_program

        return load_program(artifact_dir, weights, "cpu", sources=options.get("sources"))
