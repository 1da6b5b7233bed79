"""Which task a Hugging Face model serves: a causal LM (logits) or an encoder (hidden states).

``architectures`` in config.json is optional (GGUF conversions and hand-written configs omit
it), so it is the first clue, not the only one: without it, ``model_type`` is looked up in
transformers' own auto-model tables, the same ones ``AutoModelForCausalLM`` dispatches on.
"""

from __future__ import annotations

from typing import Any

from portlayer.errors import PortlayerError

CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


class TaskInferenceError(PortlayerError, ValueError):
    """The config does not say whether the model is a causal LM or an encoder."""


def _tables() -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    from transformers.models.auto import modeling_auto as m

    return m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, m.MODEL_FOR_MASKED_LM_MAPPING_NAMES, m.MODEL_MAPPING_NAMES


def infer_task(config: Any, where: str = "config.json") -> str:
    """'causal_lm' or 'encoder' for an HF config; raises TaskInferenceError when it cannot tell.

    Order: ``architectures`` (a *ForCausalLM / *LMHeadModel class means causal); else
    ``model_type`` in transformers' causal-LM table, except families that are also masked-LM
    encoders (BERT, RoBERTa, ...), which are causal only with ``is_decoder``; else a model
    type with a base model is an encoder.
    """
    archs = list(getattr(config, "architectures", None) or [])
    if archs:
        return "causal_lm" if any(a.endswith(CAUSAL_SUFFIXES) for a in archs) else "encoder"
    mt = getattr(config, "model_type", None)
    causal, masked, base = _tables()
    if mt in causal:
        if mt in masked:
            return "causal_lm" if getattr(config, "is_decoder", False) else "encoder"
        return "causal_lm"
    if mt in base:
        return "encoder"
    raise TaskInferenceError(
        f"{where}: cannot tell whether model_type {mt!r} is a causal LM or an encoder: it has no "
        "'architectures' field and transformers has neither a causal-LM nor a base model for that type. "
        'Add "architectures": ["<Name>ForCausalLM"] (or the base model class) to config.json.'
    )


def task_of_model(model: Any) -> str:
    """The task of a loaded module: its class first (LlamaForCausalLM vs LlamaModel), then its config."""
    name = type(model).__name__
    if name.endswith(CAUSAL_SUFFIXES):
        return "causal_lm"
    if name.endswith("Model") or getattr(model, "config", None) is None:
        return "encoder"
    return infer_task(model.config, where=f"{name}.config")
