"""GGUF block formats decoded into the ``linear_wq`` contract, without losing a bit.

Each GGUF block of 32 weights carries float16 scale(s) and 4- or 8-bit codes. They map
exactly onto ``linear_wq`` (flatten/op_defs/quant.py) at group 32:

- Q8_0: ``w = d * q`` (q int8)            -> bits 8, scale d
- Q4_0: ``w = d * (u - 8)`` (u in 0..15)  -> bits 4, q = u - 8, scale d
- Q4_1: ``w = d * u + m``                 -> bits 4, q = u - 8, scale d, offset m + 8 d

Within a block, code j (j < 16) is the low nibble of byte j and code j + 16 its high nibble
(llama.cpp's layout); linear_wq packs even/odd columns instead, so codes are re-packed.
Other types (K-quants, IQ*) are not kept natively here: the caller dequantizes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from portlayer.flatten.op_defs.quant import dequantize, pack_int4

GROUP = 32
NATIVE_FORMATS = ("Q8_0", "Q4_0", "Q4_1")


@dataclass
class NativeWeight:
    """One weight [N, K] in linear_wq form; ``offsets`` only for asymmetric formats."""

    fmt: str
    bits: int
    group_size: int
    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None = None

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, self.bits, self.group_size, self.offsets)

    def permute_rows(self, index: torch.Tensor) -> NativeWeight:
        """Rows reordered (llama's Q/K un-permutation acts on output rows; blocks run along K)."""
        off = self.offsets[index] if self.offsets is not None else None
        return NativeWeight(self.fmt, self.bits, self.group_size, self.qweight[index].contiguous(),
                            self.scales[index].contiguous(), off.contiguous() if off is not None else None)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes 0..15 in GGUF element order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode(fmt: str, raw: np.ndarray, n: int, k: int) -> NativeWeight:
    """``raw``: the tensor's bytes as GGUFReader gives them (uint8 [N, K/32 * block bytes])."""
    if k % GROUP:
        raise ValueError(f"GGUF {fmt} tensor with {k} columns: not a multiple of the block size {GROUP}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // GROUP, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if fmt == "Q8_0":
        q = blocks[..., 2:34].copy().view(np.int8).reshape(n, k)
        return NativeWeight(fmt, 8, GROUP, torch.from_numpy(q.copy()), torch.from_numpy(d))
    if fmt == "Q4_0":
        u = _nibbles(blocks[..., 2:18]).astype(np.int16).reshape(n, k)
        q = torch.from_numpy((u - 8).astype(np.int8))
        return NativeWeight(fmt, 4, GROUP, pack_int4(q), torch.from_numpy(d))
    if fmt == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        u = _nibbles(blocks[..., 4:20]).astype(np.int16).reshape(n, k)
        q = torch.from_numpy((u - 8).astype(np.int8))
        return NativeWeight(fmt, 4, GROUP, pack_int4(q), torch.from_numpy(d), torch.from_numpy(m + 8 * d))
    raise ValueError(f"GGUF {fmt} is not kept natively (kept: {', '.join(NATIVE_FORMATS)}); dequantize it")
