"""The adapter contract: what portlayer needs from a device runtime, and nothing more.

Passes, codegen and the runtime talk to a device only through this class, so a new
accelerator is one adapter plus one descriptor. Allocation honours the descriptor's
alignment because vendor kernels (CANN, TMA) reject or slow down on misaligned buffers.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from portlayer.errors import PortlayerError

if TYPE_CHECKING:
    from portlayer.capabilities.descriptor import Descriptor
    from portlayer.capabilities.probe import DetectedDevice


class BackendError(PortlayerError, RuntimeError):
    """A backend could not do what was asked; the message says which backend and what to do."""


@dataclass(frozen=True)
class MemoryInfo:
    total_bytes: int
    free_bytes: int


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class BackendAdapter(abc.ABC):
    """One device of one runtime. Subclasses set the class attributes and the abstract methods.

    ``name`` is the registry key, ``device_type`` the descriptor device_type it serves (any
    lowercase identifier: a plugin may add one the shipped schema never heard of),
    ``codegen_family`` what codegen emits for it (triton | cann | torch, or the plugin's own),
    ``descriptor_files`` descriptor JSON files a plugin ships (found by name, like the shipped
    ones). The adapter declares its devices (``probe``), and its graph-capture support
    (``supports_graph_capture``); ``compile_program`` / ``load_program`` are optional.
    """

    name: ClassVar[str]
    device_type: ClassVar[str]
    codegen_family: ClassVar[str]
    torch_device_type: ClassVar[str]
    descriptor_files: ClassVar[tuple[str, ...]] = ()

    def __init__(self, descriptor: Descriptor | None = None, index: int = 0) -> None:
        self.index = index
        self._descriptor = descriptor

    # ---- identity ------------------------------------------------------------------
    @property
    def descriptor(self) -> Descriptor:
        if self._descriptor is None:
            self._descriptor = self.default_descriptor()
        return self._descriptor

    def default_descriptor(self) -> Descriptor:
        """The descriptor probe matched for this device, else the adapter's generic one."""
        from portlayer.capabilities.descriptor import load_descriptor

        for dev in self.probe():
            if dev.index == self.index and dev.descriptor:
                return load_descriptor(dev.descriptor)
        raise BackendError(
            f"backend {self.name!r}: no descriptor matched device {self.index}; pass one explicitly, "
            "e.g. get_backend('path/to/descriptor.json')"
        )

    @property
    def torch_device(self) -> str:
        return f"{self.torch_device_type}:{self.index}"

    def __repr__(self) -> str:
        desc = self._descriptor.name if self._descriptor is not None else "?"
        return f"<{type(self).__name__} {self.torch_device} descriptor={desc}>"

    # ---- the contract --------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def probe(cls) -> list[DetectedDevice]:
        """Devices of this kind on this machine, or one 'skipped' entry saying why none."""

    @classmethod
    def is_available(cls) -> bool:
        return any(d.usable for d in cls.probe())

    @abc.abstractmethod
    def query_memory_capacity(self) -> MemoryInfo:
        """Total and free bytes the device can allocate now."""

    @abc.abstractmethod
    def _raw_allocate(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` on the device (or pinned host memory)."""

    def allocate(self, size: int, alignment: int | None = None) -> torch.Tensor:
        """``size`` bytes (rounded up to the alignment) whose address is a multiple of it.

        The alignment defaults to the descriptor's ``memory.alignment_bytes``. Over-allocating
        and slicing keeps this correct whatever alignment the underlying allocator gives.
        """
        if size < 0:
            raise BackendError(f"backend {self.name!r}: cannot allocate a negative size ({size} bytes)")
        align = alignment or self.descriptor.memory.alignment_bytes
        if align & (align - 1):
            raise BackendError(f"backend {self.name!r}: alignment {align} is not a power of two")
        return _aligned(self._raw_allocate(round_up(size, align) + align, pinned=False), round_up(size, align), align)

    def allocate_pinned(self, size: int, alignment: int | None = None) -> torch.Tensor:
        """Page-locked host memory for fast, asynchronous host<->device copies."""
        align = alignment or self.descriptor.memory.alignment_bytes
        return _aligned(self._raw_allocate(round_up(size, align) + align, pinned=True), round_up(size, align), align)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """Copy host->device, device->host or device->device; sizes must match in bytes."""
        if dst.nbytes != src.nbytes:
            raise BackendError(
                f"backend {self.name!r}: copy of {src.nbytes} bytes ({src.dtype}{list(src.shape)}) into "
                f"{dst.nbytes} bytes ({dst.dtype}{list(dst.shape)}); allocate a destination of the same size"
            )
        if dst.dtype != src.dtype or dst.shape != src.shape:
            dst.view(torch.uint8).view(-1).copy_(src.contiguous().view(torch.uint8).view(-1), non_blocking=non_blocking)
        else:
            dst.copy_(src, non_blocking=non_blocking)
        return dst

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for all queued work on this device."""

    def memory_fence_scope(self) -> str:
        """The widest group of threads that sees each other's writes without an explicit barrier."""
        return self.descriptor.memory_fence_scope

    def launches_asynchronously(self) -> bool:
        """Whether a launched step returns before the device finished it (a queue/stream), so the host
        can prepare the next step meanwhile (runtime/overlap.py). The CPU runs torch ops in place."""
        return True

    @abc.abstractmethod
    def supports_graph_capture(self) -> bool:
        """Whether a decode step can be captured once and replayed (CUDA graphs, ACL graphs)."""


def _aligned(buf: torch.Tensor, size: int, align: int) -> torch.Tensor:
    offset = (-buf.data_ptr()) % align
    out = buf[offset : offset + size]
    assert out.data_ptr() % align == 0
    return out
