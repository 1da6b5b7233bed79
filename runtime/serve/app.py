"""The FastAPI application: vLLM's OpenAI-compatible routes over one ``AsyncEngine``.

    POST /v1/completions  POST /v1/chat/completions  POST /v1/embeddings
    GET /v1/models  GET /health  GET /metrics

Errors are OpenAI-shaped JSON (``{"error": {...}}``): 400 bad parameters, a missing chat
template or a prompt longer than the context; 401 a missing or wrong API key; 404 an
unknown model name; 503 when more requests are in flight than the server admits.
"""

from __future__ import annotations

import base64
import hmac
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse, Response

from portlayer.runtime.chat import ChatTemplateError, has_chat_template, render_chat
from portlayer.runtime.sequence import RequestRejected
from portlayer.runtime.serve import generation as G
from portlayer.runtime.serve.async_engine import AsyncEngine, EngineFailed, EngineOverloaded
from portlayer.runtime.serve.metrics import ServeMetrics
from portlayer.runtime.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)


@dataclass
class ServeState:
    llm: Any  # the LLMEngine
    engine: AsyncEngine
    metrics: ServeMetrics
    model_names: list[str]
    api_key: str | None
    root: str
    token_cache: dict[int, str] = field(default_factory=dict)

    async def submit(self, subs: list[Any], queue: Any) -> list[str]:
        try:
            return await self.engine.submit(subs, queue)
        except EngineOverloaded as e:
            raise APIError(503, str(e), type="server_overloaded", code="server_overloaded") from None
        except EngineFailed as e:
            raise APIError(503, str(e), type="server_error") from None
        except (RequestRejected, ValueError) as e:
            raise APIError(400, str(e)) from None

    def check_model(self, name: str | None) -> str:
        if name is None:
            return self.model_names[0]
        if name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist. This server serves: {', '.join(self.model_names)}",
                           param="model", code="model_not_found")  # fmt: skip
        return name

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    def need_tokenizer(self, what: str) -> Any:
        if self.llm.tokenizer is None:
            raise APIError(400, f"{what} needs the model's tokenizer and this artifact has none; send token ids")
        return self.llm.tokenizer

    def token_text(self, token_id: int) -> str:
        """One token's text (logprobs), cached per server: vocabularies are bounded."""
        text = self.token_cache.get(token_id)
        if text is None:
            tok = self.llm.tokenizer
            text = self.token_cache[token_id] = tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"
        return text


def _refuse_unsupported(body: Any) -> None:
    bad = body.unsupported()
    if bad:
        raise APIError(400, f"unsupported parameter(s): {'; '.join(bad)}; omit them", param=bad[0].split("=")[0])


def _need_task(state: ServeState, generate: bool) -> None:
    task = state.llm.config.task
    if generate and task != "causal_lm":
        raise APIError(400, f"this model is an {task} model; it serves /v1/embeddings, not text generation")
    if not generate and task == "causal_lm":
        raise APIError(400, "this model is a causal LM; it serves /v1/completions and /v1/chat/completions, "
                       "not /v1/embeddings")  # fmt: skip


def _completion_prompts(state: ServeState, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty; give a string, a list of strings or token ids", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    out = []
    for p in prompt:
        out.append(list(state.need_tokenizer("a text prompt").encode(p)) if isinstance(p, str) else list(p))
        if not out[-1]:
            raise APIError(400, f"prompt {len(out) - 1} is empty", param="prompt")
    return out


def _render_chat(state: ServeState, body: ChatCompletionRequest) -> list[int]:
    tok = state.need_tokenizer("chat")
    messages = []
    for m in body.messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            if any(part.get("type") != "text" for part in m.content):
                raise APIError(400, "only text content parts are supported", param="messages")
            d["content"] = "\n".join(str(part.get("text", "")) for part in m.content)
        messages.append(d)
    try:
        return render_chat(tok, messages, body.add_generation_prompt, **(body.chat_template_kwargs or {}))
    except ChatTemplateError as e:
        code = None if has_chat_template(tok) else "no_chat_template"
        raise APIError(400, str(e), param="messages", code=code) from None


def build_app(llm: Any, model_names: list[str], *, api_key: str | None = None, max_queue_len: int = 1024,
              root: str = "") -> FastAPI:  # fmt: skip
    """The app serving ``llm`` under ``model_names``; the engine loop runs with the app.

    ``llm`` is an ``LLMEngine`` (stepped on a thread of this process, ``AsyncEngine``) or a
    started ``ProcessEngine`` (the engine-core process; its own ``max_queue_len`` applies)."""
    from portlayer.runtime.serve.process_engine import ProcessEngine

    holder: dict[str, ServeState] = {}
    core = llm if isinstance(llm, ProcessEngine) else None
    if core is not None:
        llm = core.view

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = core if core is not None else AsyncEngine(llm, max_queue_len=max_queue_len)
        metrics = ServeMetrics(engine)
        engine.step_observer = metrics.observe_step
        state = ServeState(llm, engine, metrics, list(model_names), api_key, root)
        holder["state"] = app.state.portlayer = state
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="portlayer", lifespan=lifespan)

    def st() -> ServeState:
        return holder["state"]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        parts = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {err.get('msg')}")
        first = next((".".join(str(x) for x in err.get("loc", ()) if x != "body") for err in e.errors()), None)
        return JSONResponse(APIError(400, "invalid request: " + "; ".join(parts), param=first or None).body(), 400)

    app.add_middleware(AuthAndCount, holder=holder)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if st().engine.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(st().metrics.render(), media_type=st().metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        s = st()
        data = [{"id": n, "object": "model", "created": int(time.time()), "owned_by": "portlayer", "root": s.root,
                 "max_model_len": s.llm.config.max_model_len} for n in s.model_names]  # fmt: skip
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        s = st()
        model = s.check_model(body.model)
        _need_task(s, True)
        _refuse_unsupported(body)
        prompts = _completion_prompts(s, body.prompt)
        job = await G.start_job(s, "completion", body, model, prompts, body.max_tokens, 16, body.logprobs)
        return G.stream_response(job) if body.stream else await G.whole_response(job, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        s = st()
        model = s.check_model(body.model)
        _need_task(s, True)
        _refuse_unsupported(body)
        prompt = _render_chat(s, body)
        want = (body.top_logprobs or 0) if body.logprobs else None
        job = await G.start_job(s, "chat", body, model, [prompt], body.max_completion_tokens or body.max_tokens,
                                None, want)  # fmt: skip
        return G.stream_response(job) if body.stream else await G.whole_response(job, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        s = st()
        model = s.check_model(body.model)
        _need_task(s, False)
        inputs = body.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]  # type: ignore[list-item]
        if not inputs:
            raise APIError(400, "input is empty", param="input")
        limit = int(s.llm.meta.get("max_seq_length") or s.llm.meta.get("max_positions") or 512)
        ids = [list(s.need_tokenizer("text input")(t, truncation=True, max_length=limit)["input_ids"])
               if isinstance(t, str) else list(t) for t in inputs]  # fmt: skip
        try:
            emb = await s.engine.embed(ids)
        except (RequestRejected, ValueError) as e:
            raise APIError(400, str(e), param="input") from None
        if body.dimensions is not None and body.dimensions != emb.shape[-1]:
            raise APIError(400, f"dimensions={body.dimensions}: this model's embeddings have {emb.shape[-1]} "
                           "dimensions and cannot be shortened", param="dimensions")  # fmt: skip
        rows = emb.float().cpu()
        data = []
        for i, row in enumerate(rows):
            vec: Any = (base64.b64encode(row.numpy().astype("<f4").tobytes()).decode()
                        if body.encoding_format == "base64" else row.tolist())  # fmt: skip
            data.append({"object": "embedding", "embedding": vec, "index": i})
        n = sum(len(x) for x in ids)
        s.metrics.prompt_tokens.inc(n)
        return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": n, "total_tokens": n}}

    return app


class AuthAndCount:
    """Plain ASGI middleware (no per-chunk buffering of streams): the API key on /v1 routes, and
    the request counter by route and status."""

    def __init__(self, app: Any, holder: dict[str, ServeState]) -> None:
        self.app, self.holder = app, holder

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        s = self.holder.get("state")
        if scope["type"] != "http" or s is None:
            await self.app(scope, receive, send)
            return
        path, status = scope["path"], [500]

        async def send_counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if s.api_key and path.startswith("/v1"):
                given = dict(scope["headers"]).get(b"authorization", b"")
                if not hmac.compare_digest(given, f"Bearer {s.api_key}".encode()):
                    err = APIError(401, "missing or invalid API key; send the header 'Authorization: Bearer KEY'",
                                   code="invalid_api_key")  # fmt: skip
                    await JSONResponse(err.body(), 401)(scope, receive, send_counted)
                    return
            await self.app(scope, receive, send_counted)
        finally:
            s.metrics.requests.labels(path if path in _ROUTES else "other", str(status[0])).inc()


_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/health", "/metrics"}
