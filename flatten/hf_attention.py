"""Hook HF's attention interface so that attention is captured as one opaque op.

transformers dispatches every modern model's attention through ``AttentionInterface``
and builds masks through ``AttentionMaskInterface``. Registering an implementation named
``portlayer`` in the first but not the second makes HF skip mask construction entirely
and hand us per-layer q/k/v (before GQA's repeat_kv), the scale, the sliding window and
the softcap. We forward them to the custom op ``portlayer::attention`` on token-major
[T, H, D] tensors, so the exported graph holds one node per layer that from_export maps
to the portable ``attention`` op. Masks and sequence boundaries become runtime metadata,
which is what the flat token stream needs.

Per-layer causality and window come from the mask HF built for that very layer (recorded by
flatten/hf_masks.py during a probe forward), never from module attributes: eager HF applies
the mask, and the mask is what the captured graph must reproduce. Scale and softcap are the
arguments the layer passes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from portlayer.flatten.hf_masks import IMPL_NAME, MaskSpec

__all__ = ["IMPL_NAME", "portlayer_attention_forward", "register"]


@torch.library.custom_op("portlayer::attention", mutates_args=())
def portlayer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int,
    softcap: float,
    layer: int,
) -> torch.Tensor:
    """Eager semantics (one sequence, no cache); used only while tracing."""
    from portlayer.flatten.op_defs.attention import attention_reference

    pos = torch.arange(q.shape[0], device=q.device)
    return attention_reference(
        q, k, v, scale=scale, causal=causal, sliding_window=sliding_window or None,
        softcap=softcap or None, q_pos=pos,
    )


@portlayer_attention.register_fake
def _fake(q, k, v, scale, causal, sliding_window, softcap, layer):  # noqa: ANN001
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


def _as_int(x: Any) -> int:
    return int(x) if x is not None else 0


#: tensor keyword arguments models pass to AttentionInterface that do not change what attention computes here
#: (positions and sequence boundaries: the attention op takes those from the run-time metadata)
_HARMLESS_TENSOR_KWARGS = frozenset({"position_ids", "cache_position", "cu_seq_lens_q", "cu_seq_lens_k",
                                     "max_length_q", "max_length_k", "head_mask"})


def portlayer_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry: query [B=1, Hq, T, D], key/value [1, Hkv, S, D]."""
    if query.shape[0] != 1:
        raise ValueError(
            f"portlayer captures one flattened token stream (batch 1); got query batch {query.shape[0]} "
            f"in {type(module).__name__}"
        )
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        raise ValueError(
            f"{type(module).__name__} passed an explicit 4-D attention mask; portlayer builds masks from "
            "attention metadata at run time. Capture without attention_mask."
        )
    changes = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in _HARMLESS_TENSOR_KWARGS)
    if changes:  # e.g. GPT-OSS's attention sinks (s_aux): dropping them would change every output
        raise ValueError(
            f"{type(module).__name__} passes {', '.join(changes)} to its attention, which the attention op does "
            "not take; capture is refused rather than leaving it out of the computation"
        )
    module._portlayer_attention_seen = True
    spec = attention_mask if isinstance(attention_mask, MaskSpec) else module.__dict__.get("_portlayer_mask")
    if isinstance(attention_mask, MaskSpec):
        module._portlayer_mask = attention_mask
    if spec is not None:
        if spec.error:
            raise ValueError(f"{type(module).__name__}: {spec.error}; capture is refused rather than changing "
                             "which tokens attend to which")
        causal, window = spec.causal, spec.sliding_window
    else:  # the model built no mask through masking_utils: only the arguments say it
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        window = sliding_window
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    cap = softcap
    # The KV-cache layer index is assigned later, in graph order (from_export), so that
    # modules without ``layer_idx`` (BERT) are numbered too.
    layer = 0
    t = query.shape[2]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    out = torch.ops.portlayer.attention(
        q, k, v, float(scale), bool(causal), _as_int(window), float(cap or 0.0), int(layer)
    )
    # contiguous as HF's eager and sdpa outputs are: modeling code may .view() it (AFMoE)
    return out.reshape(1, t, query.shape[1], value.shape[-1]).contiguous(), None


def register() -> None:
    """Make ``attn_implementation="portlayer"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPL_NAME, portlayer_attention_forward)

