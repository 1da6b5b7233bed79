"""The CUDA adapter (NVIDIA through torch.cuda): memory, sync, graph capture, and the
Triton program: compile_program renders kernels + host program, load_program imports them
(Triton's JIT cache under portlayer's cache dir)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from portlayer.backends.base import BackendAdapter, BackendError, MemoryInfo
from portlayer.backends.registry import register_backend

if TYPE_CHECKING:
    from portlayer.capabilities.probe import DetectedDevice


@register_backend("cuda")
class CUDAAdapter(BackendAdapter):
    device_type = "cuda"
    codegen_family = "triton"
    torch_device_type = "cuda"

    def __init__(self, descriptor=None, index: int = 0) -> None:
        super().__init__(descriptor, index)
        if descriptor is not None and descriptor.device_type != self.device_type:
            raise BackendError(
                f"backend 'cuda' got descriptor {descriptor.name!r} for device_type {descriptor.device_type!r}; "
                "pass a cuda descriptor or use get_backend(descriptor) to pick the matching backend"
            )

    @classmethod
    def probe(cls) -> list[DetectedDevice]:
        from portlayer.capabilities.probe import probe_devices

        return [d for d in probe_devices() if d.device_type == "cuda"]

    def _require(self) -> None:
        if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
            reasons = "; ".join(d.reason for d in self.probe()) or "no CUDA device"
            raise BackendError(f"backend 'cuda' is not usable here: {reasons}")
        if self.index >= torch.cuda.device_count():
            raise BackendError(
                f"backend 'cuda': device index {self.index} out of range ({torch.cuda.device_count()} devices)"
            )

    def query_memory_capacity(self) -> MemoryInfo:
        self._require()
        free, total = torch.cuda.mem_get_info(self.index)
        return MemoryInfo(total_bytes=total, free_bytes=free)

    def _raw_allocate(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        self._require()
        if pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)

    def synchronize(self) -> None:
        self._require()
        torch.cuda.synchronize(self.index)

    def supports_graph_capture(self) -> bool:
        return self.descriptor.has("graph_capture") and hasattr(torch.cuda, "CUDAGraph")

    # ---- the program ---------------------------------------------------------------
    def compile_program(self, result, out_dir) -> list:
        """Generated Triton kernels and host program for a PipelineResult, written to out_dir."""
        from portlayer.backends.triton_program import compile_program

        return compile_program(result, out_dir, self.descriptor)

    def load_program(self, artifact_dir, weights, plan=None, **options):
        """The Executable (runtime/executable.py) for a compiled artifact on this device."""
        from portlayer.backends.triton_program import load_program

        self._require()
        if not self.supports_graph_capture():
            options["use_graphs"] = False
        return load_program(artifact_dir, weights, self.torch_device, plan, **options)
