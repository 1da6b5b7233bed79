"""The Intel XPU adapter (torch.xpu). Triton kernels come from the same templates with the
XPU descriptor's Plan, and need Intel's Triton (intel-xpu-backend-for-triton) to compile:
PyPI Triton has no XPU backend, so XPU programs are generated and tested for rendering
only (see docs/gpu.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from portlayer.backends.base import BackendAdapter, BackendError, MemoryInfo
from portlayer.backends.registry import register_backend

if TYPE_CHECKING:
    from portlayer.capabilities.probe import DetectedDevice


@register_backend("xpu")
class XPUAdapter(BackendAdapter):
    device_type = "xpu"
    codegen_family = "triton"
    torch_device_type = "xpu"

    @classmethod
    def probe(cls) -> list[DetectedDevice]:
        from portlayer.capabilities.probe import probe_devices

        return [d for d in probe_devices() if d.device_type == "xpu"]

    def _xpu(self):
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            reasons = "; ".join(d.reason for d in self.probe()) or "no XPU device"
            raise BackendError(f"backend 'xpu' is not usable here: {reasons}")
        return xpu

    def query_memory_capacity(self) -> MemoryInfo:
        xpu = self._xpu()
        total = xpu.get_device_properties(self.index).total_memory
        if hasattr(xpu, "mem_get_info"):
            free = xpu.mem_get_info(self.index)[0]
        else:  # older torch: what this process has not allocated
            free = total - xpu.memory_allocated(self.index)
        return MemoryInfo(total_bytes=total, free_bytes=free)

    def _raw_allocate(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        self._xpu()
        if pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)

    def synchronize(self) -> None:
        self._xpu().synchronize(self.index)

    def supports_graph_capture(self) -> bool:
        return False  # no XPU graph API is used; decode launches eagerly

    def compile_program(self, result, out_dir) -> list:
        from portlayer.backends.triton_program import compile_program

        return compile_program(result, out_dir, self.descriptor)

    def load_program(self, artifact_dir, weights, plan=None, **options):
        from portlayer.backends.triton_program import load_program

        self._xpu()
        options["use_graphs"] = False
        return load_program(artifact_dir, weights, self.torch_device, plan, **options)
