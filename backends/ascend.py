"""The Ascend adapter (Huawei 910B through torch_npu / CANN).

compile_program writes the generated CANN op-call program (codegen/cann.py); load_program
imports it and binds it to ``npu``: the real ``torch_npu`` module on an Ascend machine, or
portlayer's CPU emulator of the calls (backends/ascend_emulator.py) anywhere else. Nothing
in this repository has run on Ascend hardware; see docs/ascend.md.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from portlayer.backends.base import BackendAdapter, BackendError, MemoryInfo
from portlayer.backends.registry import register_backend

if TYPE_CHECKING:
    from portlayer.capabilities.probe import DetectedDevice

#: set to 1 to run Ascend artifacts on the CPU emulator (e.g. `PORTLAYER_ASCEND_EMULATOR=1 portlayer validate ART`)
EMULATOR_ENV = "PORTLAYER_ASCEND_EMULATOR"


def emulator_requested() -> bool:
    return os.environ.get(EMULATOR_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@register_backend("ascend")
class AscendAdapter(BackendAdapter):
    device_type = "ascend"
    codegen_family = "cann"
    torch_device_type = "npu"

    def __init__(self, descriptor=None, index: int = 0, *, emulate: bool | None = None) -> None:
        super().__init__(descriptor, index)
        if descriptor is not None and descriptor.device_type != self.device_type:
            raise BackendError(f"backend 'ascend' got descriptor {descriptor.name!r} for device_type "
                               f"{descriptor.device_type!r}; pass an ascend descriptor")
        self.emulate = emulator_requested() if emulate is None else emulate

    def default_descriptor(self):
        if self.emulate:
            from portlayer.capabilities.descriptor import load_descriptor

            return load_descriptor("ascend-910b")
        return super().default_descriptor()

    @property
    def torch_device(self) -> str:
        return "cpu" if self.emulate else f"npu:{self.index}"

    @classmethod
    def probe(cls) -> list[DetectedDevice]:
        from portlayer.capabilities.probe import probe_devices

        return [d for d in probe_devices() if d.device_type == "ascend"]

    def _require(self) -> None:
        if self.emulate:
            return
        if not any(d.usable for d in self.probe()):
            reasons = "; ".join(d.reason for d in self.probe()) or "no Ascend NPU"
            raise BackendError(f"backend 'ascend' is not usable here: {reasons}. To run on the CPU emulator of the "
                               f"torch_npu calls instead, set {EMULATOR_ENV}=1 (emulation, not the NPU)")

    def query_memory_capacity(self) -> MemoryInfo:
        self._require()
        if self.emulate:
            import os as _os

            page = _os.sysconf("SC_PAGE_SIZE")
            total = page * _os.sysconf("SC_PHYS_PAGES")
            return MemoryInfo(total_bytes=total, free_bytes=total)
        free, total = torch.npu.mem_get_info(self.index)  # type: ignore[attr-defined]
        return MemoryInfo(total_bytes=total, free_bytes=free)

    def _raw_allocate(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        self._require()
        if self.emulate or pinned:
            return torch.empty(nbytes, dtype=torch.uint8)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)

    def synchronize(self) -> None:
        self._require()
        if not self.emulate:
            torch.npu.synchronize(self.index)  # type: ignore[attr-defined]

    def supports_graph_capture(self) -> bool:
        return False  # ACL graph capture of the generated program is not built

    # ---- the program ---------------------------------------------------------------
    def compile_program(self, result, out_dir) -> list:
        """The generated CANN op-call host program for a PipelineResult, written to out_dir."""
        from portlayer.backends.generate import generate
        from portlayer.codegen.program import write_program

        gen = generate(result.graph, getattr(result, "plan", None), getattr(result, "descriptor", None) or self.descriptor)
        return write_program(gen, out_dir)

    def load_program(self, artifact_dir, weights, plan=None, npu: Any = None, **options):
        """The Executable of a compiled artifact. ``npu``: the module whose functions the program calls
        (default: ``import torch_npu`` on a real NPU, or the CPU emulator when this adapter emulates)."""
        from portlayer.codegen.program import load_program

        if npu is None:
            if self.emulate:
                from portlayer.backends.ascend_emulator import AscendEmulator

                npu = AscendEmulator()
            else:
                self._require()
                import torch_npu as npu  # noqa: F401 - the real stack
        device = "cpu" if getattr(npu, "is_emulator", False) else self.torch_device
        return load_program(artifact_dir, weights, device, npu=npu, sources=options.get("sources"))
