"""Chat messages to prompt token ids through the model's own chat template.

The template is the tokenizer's (``tokenizer/chat_template.jinja`` in an artifact, which
transformers loads with the tokenizer); ``apply_chat_template`` renders it in transformers'
sandboxed jinja environment. The rendered text is tokenized without adding special tokens,
because the template already wrote any BOS it wants (vLLM does the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from portlayer.errors import PortlayerError


class ChatTemplateError(PortlayerError):
    """The model has no chat template, or the template refused these messages."""


def has_chat_template(tokenizer: Any) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                **template_kwargs: Any) -> list[int]:  # fmt: skip
    """Token ids of ``messages`` rendered with the model's chat template (ChatTemplateError if it has none)."""
    if not has_chat_template(tokenizer):
        where = getattr(tokenizer, "name_or_path", None) or "this model"
        raise ChatTemplateError(f"{where} has no chat template (no chat_template.jinja beside its tokenizer), so chat "
                                "messages cannot be rendered; send a plain prompt instead")  # fmt: skip
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **template_kwargs)  # fmt: skip
    except Exception as e:  # jinja2 errors, raise_exception() inside the template
        raise ChatTemplateError(f"the chat template could not render these messages: {type(e).__name__}: {e}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))
