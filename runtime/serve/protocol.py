"""Request bodies of the OpenAI-compatible routes (OpenAI's names, plus vLLM's extras).

Fields a client may send but portlayer does not implement are accepted only at their
neutral value: a non-zero ``frequency_penalty`` or an ``echo`` is refused with a 400 that
names it, rather than silently ignored (a silently different output is the worst bug).
Unknown fields are ignored, as OpenAI's and vLLM's servers do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An OpenAI-shaped error: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          "object": "error"}}  # fmt: skip


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Generation(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = 0  # vLLM extra; 0 or -1 = off
    seed: int | None = None
    stop: str | list[str | int] | None = None  # ints are token ids (as stop_token_ids)
    stop_token_ids: list[int] = Field(default_factory=list)  # vLLM extra
    ignore_eos: bool = False  # vLLM extra
    return_token_ids: bool = False  # vLLM extra: each choice (and chunk) also carries its token ids
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # accepted only at their neutral values (see the module docstring)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    best_of: int | None = None
    user: str | None = None

    def unsupported(self) -> list[str]:
        bad = []
        for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0),
                              ("min_tokens", 0)):  # fmt: skip
            v = getattr(self, name)
            if v is not None and v != neutral:
                bad.append(f"{name}={v} (only {neutral} is supported)")
        if self.logit_bias:
            bad.append("logit_bias (not supported)")
        if self.best_of is not None and self.best_of != self.n:
            bad.append(f"best_of={self.best_of} (only best_of == n is supported)")
        return bad

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        items = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in items if isinstance(s, str)]

    def stop_ids(self) -> list[int]:
        items = [] if self.stop is None or isinstance(self.stop, str) else self.stop
        return [int(t) for t in items if isinstance(t, int)] + [int(t) for t in self.stop_token_ids]


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.echo:
            bad.append("echo=true (not supported)")
        if self.suffix:
            bad.append("suffix (not supported)")
        return bad


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... reach the template as given
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True  # vLLM extra
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extra, e.g. {"enable_thinking": false}
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.tools:
            bad.append("tools (not supported)")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            bad.append(f"response_format={self.response_format.get('type')!r} (only 'text' is supported)")
        return bad


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
