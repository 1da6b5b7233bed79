"""Weight-only quantized linear: the semantics every quantized GEMM kernel is checked against.

``qweight`` holds the weight of ``linear`` ([out, in]) as signed integers: int8 as is, int4
packed two per byte (low nibble = even input column, each nibble stores q + 8 in 0..15).
``scales`` [out, in // group_size] are the group-wise (or per-channel when group_size == in)
scales, so ``weight ≈ q * scale``. The optional ``offsets`` (same shape and dtype as
``scales``) make the format asymmetric: ``weight ≈ q * scale + offset`` per group. That is
how block formats with a minimum (GGUF's Q4_1: ``w = d * u + m`` with ``u`` in 0..15) are
kept exactly: ``q = u - 8``, ``scale = d``, ``offset = m + 8 * d``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from portlayer.flatten.ir import TensorType
from portlayer.flatten.ops import op


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> int8 [N, K] in -8..7 (low nibble first)."""
    p = packed.to(torch.int16)
    lo, hi = (p & 0xF) - 8, (p >> 4) - 8
    return torch.stack((lo, hi), dim=-1).reshape(packed.shape[0], -1).to(torch.int8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] in -8..7 -> uint8 [N, K/2] (low nibble = even column)."""
    u = (q.to(torch.int16) + 8).reshape(q.shape[0], -1, 2)
    return (u[..., 0] | (u[..., 1] << 4)).to(torch.uint8)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
               offsets: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [N, K] weight from its quantized form."""
    q = unpack_int4(qweight) if bits == 4 else qweight
    n, k = q.shape
    w = q.float().reshape(n, k // group_size, group_size) * scales.float()[:, :, None]
    if offsets is not None:
        w = w + offsets.float()[:, :, None]
    return w.reshape(n, k)


def _infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    x, qw, sc = ins[0], ins[1], ins[2]
    bits, g = a["bits"], a["group_size"]
    k = qw.shape[1] * (2 if bits == 4 else 1)
    want = "uint8" if bits == 4 else "int8"
    if bits not in (4, 8):
        raise ValueError(f"linear_wq: bits={bits}; only 8 and 4 are defined")
    if qw.dtype != want:
        raise ValueError(f"linear_wq: {bits}-bit qweight must be {want}, got {qw}")
    if x.shape[-1] != k:
        raise ValueError(f"linear_wq: x {list(x.shape)} does not match the unpacked weight K={k}")
    if not g or k % g or tuple(sc.shape) != (qw.shape[0], k // g):
        raise ValueError(f"linear_wq: scales {sc} must be [{qw.shape[0]}, {k}//group_size={g}]")
    off = ins[4] if len(ins) > 4 else None
    if off is not None and (tuple(off.shape) != tuple(sc.shape) or off.dtype != sc.dtype):
        raise ValueError(f"linear_wq: offsets {off} must match scales {sc} in shape and dtype")
    return [TensorType(x.dtype, tuple(x.shape[:-1]) + (qw.shape[0],))]


def _flops(ins, outs, a, b) -> int:
    k = ins[1].shape[1] * (2 if a["bits"] == 4 else 1)
    return 2 * outs[0].numel(b) * int(k)


@op("linear_wq", kind="gemm", inputs=("x", "qweight", "scales", "bias?", "offsets?"),
    attrs={"bits": 8, "group_size": 0}, infer=_infer, flops=_flops)
def linear_wq(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
              offsets: torch.Tensor | None = None, bits: int = 8, group_size: int = 0) -> torch.Tensor:
    """x @ dequantize(qweight, scales[, offsets]).T (+ bias), the weight dequantized into x's dtype."""
    w = dequantize(qweight, scales, bits, group_size, offsets).to(x.dtype)
    return F.linear(x, w, bias)
