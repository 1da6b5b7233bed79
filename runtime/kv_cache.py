"""Per-layer paged K/V tensors, sized from the Plan and allocated through the backend adapter.

Layout per layer (the attention op's contract): key and value caches of
``[num_blocks, block_size, num_kv_heads, head_dim]`` (values: ``v_head_dim`` when it differs,
as in DeepSeek's expanded MLA: K 192 wide, V 128). The MLA latent layout (``mla_attention``,
graph.meta ``kv_layout: mla_latent``) is one "head" of kv_lora_rank + rope per token in the key
cache and a value cache of width 0, so a block costs (rank + rope) per token. Memory comes from
``BackendAdapter.allocate`` so it honours the descriptor's alignment (vendor kernels
reject or slow down on misaligned buffers); the block count is whatever fits the budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from portlayer.errors import PortlayerError


class KVCacheError(PortlayerError):
    """The KV cache cannot be built as asked; the message says what to change."""


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the cache; one (K, V) pair per attention layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    v_head_dim: int | None = None  # None: the same as head_dim; 0: no value cache (MLA's latent cache)

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @staticmethod
    def from_meta(meta: Mapping[str, Any], block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """Read the layer/head facts that capture recorded in ``graph.meta``."""
        missing = [k for k in ("num_layers", "num_kv_heads", "head_dim") if not meta.get(k)]
        if missing:
            raise KVCacheError(
                f"graph.meta lacks {missing} (model {meta.get('source', '?')}); the KV cache is sized from them. "
                "Capture the model with portlayer.flatten.capture, which records them."
            )
        v = int(meta["v_head_dim"]) if meta.get("v_head_dim") is not None else None
        return KVCacheSpec(int(meta["num_layers"]), int(meta["num_kv_heads"]), int(meta["head_dim"]), block_size, dtype,
                           v if v != int(meta["head_dim"]) else None)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across every layer."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.block_size * self.num_kv_heads * (self.head_dim + self.value_dim) * itemsize

    def num_blocks_for(self, budget_bytes: int) -> int:
        return int(budget_bytes // self.bytes_per_block)


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, backend: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed K/V caches for every layer, each an aligned allocation from ``backend``.

    Zeroing keeps never-written slots finite: a kernel that masks them after the dot
    product (0 * garbage) would otherwise turn NaN.
    """
    if num_blocks < 1:
        raise KVCacheError(
            f"the KV cache budget holds no block ({spec.bytes_per_block} bytes per block of {spec.block_size} tokens "
            f"over {spec.num_layers} layers); raise kv_cache_budget_bytes"
        )
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    caches = []
    for _ in range(spec.num_layers):
        pair = []
        for dim in (spec.head_dim, spec.value_dim):
            shape = (num_blocks, spec.block_size, spec.num_kv_heads, dim)
            nbytes = num_blocks * spec.block_size * spec.num_kv_heads * dim * itemsize
            raw = backend.allocate(max(nbytes, 1))
            t = raw[:nbytes].view(spec.dtype).view(shape)
            t.zero_()
            pair.append(t)
        caches.append((pair[0], pair[1]))
    return caches
