"""Hook HF's attention interface so that attention is captured as one opaque op.

transformers dispatches every modern model's attention through ``AttentionInterface``
and builds masks through ``AttentionMaskInterface``. Registering an implementation named
``portlayer`` in the first but not the second makes HF skip mask construction entirely
and hand us per-layer q/k/v (before GQA's repeat_kv), the scale, the sliding window and
the softcap. We forward them to the custom op ``portlayer::attention`` on token-major
[T, H, D] tensors, so the exported graph holds one node per layer that from_export maps
to the portable ``attention`` op. Masks and sequence boundaries become runtime metadata,
which is what the flat token stream needs.
"""

from __future__ import annotations

import math
from typing import Any

import torch

IMPL_NAME = "portlayer"


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
    if attention_mask is not None and attention_mask.dim() == 4:
        raise ValueError(
            f"{type(module).__name__} passed an explicit 4-D attention mask; portlayer builds masks from "
            "attention metadata at run time. Capture without attention_mask."
        )
    module._portlayer_attention_seen = True
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    cap = softcap if softcap is not None else getattr(module, "attn_logit_softcapping", None)
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
    return out.reshape(1, t, query.shape[1], value.shape[-1]), None


def register() -> None:
    """Make ``attn_implementation="portlayer"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPL_NAME, portlayer_attention_forward)

