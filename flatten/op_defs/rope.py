"""Rotary position embedding as one op over a precomputed cos/sin cache."""

from __future__ import annotations

from typing import Any

import torch

from portlayer.flatten.ir import TensorType
from portlayer.flatten.ops import op, out_numel_flops


def _rope_infer(ins: list[TensorType | None], a: dict[str, Any]) -> list[TensorType]:
    x, pos, cache = ins
    if x.shape[-1] != a["head_dim"] and a["head_dim"]:
        raise ValueError(f"rope: x {x} last dim is not head_dim={a['head_dim']}")
    if int(cache.shape[-1]) != a["rotary_dim"]:
        raise ValueError(f"rope: cos_sin_cache {cache} last dim must equal rotary_dim={a['rotary_dim']}")
    return [x]


@op("rope", kind="pointwise", inputs=("x", "positions", "cos_sin_cache"),
    attrs={"style": "neox", "rotary_dim": 0, "head_dim": 0}, infer=_rope_infer, flops=out_numel_flops(3))
def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, style: str = "neox",
         rotary_dim: int = 0, head_dim: int = 0) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` features of each head of x [T, H, D] by position.

    cos_sin_cache is [max_positions, rotary_dim]: cos in the first half, sin in the second
    (vLLM's layout). 'neox' pairs feature i with i + rotary_dim/2 (rotate_half); 'gptj'
    pairs adjacent features (2i, 2i+1). The math runs in x's dtype, as HF does.
    """
    half = rotary_dim // 2
    cs = cos_sin_cache[positions.long()].to(x.dtype)  # [T, rotary_dim]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if style == "neox":
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    elif style == "gptj":
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        raise ValueError(f"rope style {style!r} is not 'neox' or 'gptj'")
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
