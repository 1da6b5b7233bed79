"""Hook HF's experts interface so that the routed experts are captured as one op.

transformers (5.x) stores MoE experts as 3-D weights and dispatches their forward through
``ExpertsInterface`` (``@use_experts_implementation``: Qwen3-MoE, DeepSeek-V3, GLM-4-MoE,
Mixtral, ...), the way attention goes through ``AttentionInterface``. Registering an
implementation named ``portlayer`` hands us hidden states, each token's expert ids and
weights, and the expert weights; we forward them to the custom op ``portlayer::moe_experts``
that from_export maps to the portable ``moe_experts`` op. This is a hook rather than a
pattern over HF's eager loop because that loop is data-dependent (``nonzero``, ``where``,
per-expert gathers) and cannot be exported with a dynamic token count at all. The router
stays the model's own code, captured op by op, so every scoring variant is exact.

Only the layout the op expresses is hooked (gate and up concatenated, not transposed, no
bias, the default gate); any other experts module keeps its original forward, and capture
then fails on its loop with the usual unsupported-op error instead of computing wrongly.
"""

from __future__ import annotations

from typing import Any

import torch

from portlayer.flatten.op_defs.moe import ACTIVATIONS, moe_experts

IMPL_NAME = "portlayer"
_ACT_NAMES = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


@torch.library.custom_op("portlayer::moe_experts", mutates_args=())
def portlayer_moe_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
    w_down: torch.Tensor, activation: str,
) -> torch.Tensor:
    """Eager semantics (the op's reference); used only while tracing."""
    return moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down, num_experts=w_gate_up.shape[0],
                       top_k=topk_ids.shape[1], intermediate_size=w_down.shape[2], activation=activation)


@portlayer_moe_experts.register_fake
def _fake(x, topk_ids, topk_weights, w_gate_up, w_down, activation):  # noqa: ANN001
    return x.new_empty(x.shape)


def activation_of(module: torch.nn.Module) -> str | None:
    """The op's name for the experts' activation, proven by type against HF's ACT2FN entry."""
    from transformers.activations import ACT2FN

    name = getattr(getattr(module, "config", None), "hidden_act", None)
    ours = _ACT_NAMES.get(str(name))
    if ours is None or ours not in ACTIVATIONS or type(getattr(module, "act_fn", None)) is not type(ACT2FN[name]):
        return None
    return ours


def expressible(module: torch.nn.Module) -> bool:
    """Is this experts module the layout ``moe_experts`` computes?"""
    from transformers.integrations.moe import _default_apply_gate

    return (
        getattr(module, "has_gate", False) and not getattr(module, "has_bias", True)
        and getattr(module, "is_concatenated", False) and not getattr(module, "is_transposed", True)
        and not getattr(module, "has_post_expert_norm", False)
        and getattr(type(module), "_apply_gate", None) is _default_apply_gate
        and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(module, "down_proj", None), torch.Tensor)
        and module.gate_up_proj.dim() == 3 and module.down_proj.dim() == 3
        and activation_of(module) is not None
    )


def portlayer_experts_forward(
    module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor, *args: Any, **kwargs: Any,
) -> torch.Tensor:
    """ExpertsInterface entry: hidden [T, H], top_k_index / top_k_weights [T, k]."""
    if not expressible(module) or args or kwargs:
        return type(module).forward.__wrapped__(module, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    module._portlayer_moe_seen = True
    return torch.ops.portlayer.moe_experts(
        hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj, activation_of(module)
    )


def register() -> None:
    """Make ``experts_implementation="portlayer"`` known to transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPL_NAME, portlayer_experts_forward)


def use_portlayer_experts(model: torch.nn.Module) -> None:
    """Route the model's experts modules through the hook (models without experts: no-op)."""
    register()
    if hasattr(model, "set_experts_implementation") and model._can_set_experts_implementation():
        model.set_experts_implementation(IMPL_NAME)
