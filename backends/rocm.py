"""The ROCm adapter (AMD through torch's HIP build, which answers as torch.cuda).

Same Triton templates as CUDA, rendered with the ROCm descriptor's Plan (64-wide
wavefronts halve num_warps; shared memory bounds num_stages). Kernels were compiled ahead
of time for gfx942 and gfx1100 here, never run on an AMD GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from portlayer.backends.base import BackendError
from portlayer.backends.cuda import CUDAAdapter
from portlayer.backends.registry import register_backend

if TYPE_CHECKING:
    from portlayer.capabilities.probe import DetectedDevice


@register_backend("rocm")
class ROCmAdapter(CUDAAdapter):
    device_type = "rocm"
    torch_device_type = "cuda"  # HIP builds of torch expose AMD GPUs as "cuda" devices

    @classmethod
    def probe(cls) -> list[DetectedDevice]:
        from portlayer.capabilities.probe import probe_devices

        return [d for d in probe_devices() if d.device_type == "rocm"]

    def _require(self) -> None:
        if not torch.cuda.is_available() or not getattr(torch.version, "hip", None):
            reasons = "; ".join(d.reason for d in self.probe()) or "no ROCm device"
            raise BackendError(f"backend 'rocm' is not usable here: {reasons}")
        if self.index >= torch.cuda.device_count():
            raise BackendError(f"backend 'rocm': device index {self.index} out of range")
