"""Completions and chat completions: prompts in, choices out, streamed (SSE) or whole.

Both routes reduce to the same thing: a list of prompt token-id lists, ``n`` choices per
prompt, one engine request per choice (choice index ``prompt * n + j``, OpenAI's order).
Each choice's text goes through a ``TextStream`` (incremental detokenization, stop
strings). A choice that hits a stop string is aborted in the engine at once, so its KV
blocks are freed; a client that disconnects aborts every choice it still has running.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from portlayer.runtime.detokenizer import TextStream
from portlayer.runtime.sequence import SamplingParams
from portlayer.runtime.serve.async_engine import EngineFailed, StepItem, Submission
from portlayer.runtime.serve.logprobs import TokenLogprob
from portlayer.runtime.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest


@dataclass
class Choice:
    index: int
    rid: str
    text: TextStream
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    last_time: float | None = None
    started_role: bool = False  # chat streams open each choice with a role delta

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationJob:
    """One HTTP request's choices, the engine requests behind them, and how to report them."""

    state: Any  # app.ServeState
    kind: str  # "completion" | "chat"
    model: str
    prompts: list[list[int]]
    choices: dict[str, Choice]
    queue: asyncio.Queue
    arrival: float
    want_logprobs: int | None
    stream_usage: bool
    token_ids: bool  # report token ids per choice / chunk (asked for, or the model has no tokenizer)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def obj_id(self) -> str:
        return ("cmpl-" if self.kind == "completion" else "chatcmpl-") + self.id

    def usage(self) -> dict[str, int]:
        p = sum(len(x) for x in self.prompts)
        c = sum(ch.num_tokens for ch in self.choices.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def abort_unfinished(self) -> None:
        self.state.engine.abort([c.rid for c in self.choices.values() if not c.done])

    # ---- one step's output for one choice ----------------------------------------------
    def absorb(self, item: StepItem | BaseException) -> tuple[Choice, str, bool]:
        """Apply one queue item: its choice, the text now safe to send, and False if the item
        was stale (its choice had already ended on a stop string)."""
        if isinstance(item, BaseException):
            self.abort_unfinished()
            raise APIError(500, str(item), type="server_error") if isinstance(item, EngineFailed) else item
        out, m = item.output, self.state.metrics
        c = self.choices[out.request_id]
        if c.done:  # already ended by a stop string; the engine is aborting it
            return c, "", False
        if c.last_time is None:
            m.ttft.observe(item.time - self.arrival)
        else:
            m.itl.observe(item.time - c.last_time)
        c.last_time = item.time
        c.num_tokens += len(out.new_token_ids)
        c.token_ids.extend(out.new_token_ids)
        m.generation_tokens.inc(len(out.new_token_ids))
        c.logprobs.extend(item.logprobs)
        delta = c.text.add(out.new_token_ids, final=out.finished)
        if c.text.stopped:
            c.finish_reason, c.stop_reason = "stop", c.text.stop_reason
            if not out.finished:
                self.state.engine.abort([c.rid])
        elif out.finished:
            c.finish_reason = out.finish_reason or "stop"
            last = out.new_token_ids[-1] if out.new_token_ids else None
            if c.finish_reason == "stop" and last is not None and last != self.state.llm.eos_token_id:
                c.stop_reason = last  # a stop token id (vLLM reports which one)
        if c.done:
            m.request_success.labels(c.finish_reason).inc()
            m.e2e.observe(item.time - self.arrival)
        return c, delta, True

    # ---- bodies ----------------------------------------------------------------------
    def _logprobs_body(self, c: Choice, records: list[TokenLogprob], offset: int) -> dict[str, Any] | None:
        if self.want_logprobs is None:
            return None
        dec = self.state.token_text
        if self.kind == "chat":
            return {"content": [{"token": dec(r.token_id), "logprob": r.logprob,
                                 "bytes": list(dec(r.token_id).encode()),
                                 "top_logprobs": [{"token": dec(t), "logprob": v, "bytes": list(dec(t).encode())}
                                                  for t, v in r.top]} for r in records]}  # fmt: skip
        tokens = [dec(r.token_id) for r in records]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [r.logprob for r in records], "text_offset": offsets,
                "top_logprobs": [{dec(t): v for t, v in r.top} for r in records]}  # fmt: skip

    def final_body(self) -> dict[str, Any]:
        choices = []
        for c in sorted(self.choices.values(), key=lambda c: c.index):
            lp = self._logprobs_body(c, c.logprobs, 0)
            if self.kind == "chat":
                ch = {"index": c.index, "message": {"role": "assistant", "content": c.text.text},
                      "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
            else:
                ch = {"index": c.index, "text": c.text.text, "logprobs": lp, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}  # fmt: skip
            if self.token_ids:
                ch["token_ids"] = list(c.token_ids)
            choices.append(ch)
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        return {"id": self.obj_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}  # fmt: skip

    def chunk(self, c: Choice, delta: str, records: list[TokenLogprob], sent_chars: int,
              new_ids: list[int] | None = None) -> dict[str, Any]:  # fmt: skip
        lp = self._logprobs_body(c, records, sent_chars) if records else None
        if self.kind == "chat":
            d: dict[str, Any] = {"content": delta} if delta else {}
            if not c.started_role:
                d, c.started_role = {"role": "assistant", "content": delta}, True
            ch = {"index": c.index, "delta": d, "logprobs": lp, "finish_reason": c.finish_reason}
            obj = "chat.completion.chunk"
        else:
            ch = {"index": c.index, "text": delta, "logprobs": lp, "finish_reason": c.finish_reason}
            obj = "text_completion"
        if c.done:
            ch["stop_reason"] = c.stop_reason
        if self.token_ids:
            ch["token_ids"] = new_ids or []
        return {"id": self.obj_id, "object": obj, "created": self.created, "model": self.model, "choices": [ch],
                "usage": None}  # fmt: skip


# ---- building a job from a request -----------------------------------------------------------
def sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int, j: int) -> SamplingParams:
    seed = None if body.seed is None else body.seed + j  # n choices: n different, reproducible streams
    try:
        return SamplingParams(temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p, seed=seed,
                              max_tokens=max_tokens, stop_token_ids=tuple(body.stop_ids()),
                              ignore_eos=body.ignore_eos)  # fmt: skip
    except ValueError as e:
        raise APIError(400, str(e)) from None


def resolve_max_tokens(state: Any, prompt: list[int], asked: int | None, default: int | None, what: str) -> int:
    """``asked`` if it fits the context (else a 400, as vLLM), otherwise the room left (capped at ``default``)."""
    limit = state.llm.config.max_model_len
    room = limit - len(prompt)
    if room < 1 or (asked is not None and asked > room):
        want = len(prompt) + (asked or 1)
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested {want} "
                       f"tokens ({len(prompt)} in the {what}, {asked or 1} in the completion). Please reduce the "
                       f"length of the {what} or completion.", param=what, code="context_length_exceeded")  # fmt: skip
    return asked if asked is not None else min(room, default) if default else room


async def start_job(state: Any, kind: str, body: Any, model: str, prompts: list[list[int]], max_tokens: int | None,
                    default_max: int | None, want_logprobs: int | None) -> GenerationJob:  # fmt: skip
    what = "prompt" if kind == "completion" else "messages"
    subs, meta = [], []
    for i, p in enumerate(prompts):
        mt = resolve_max_tokens(state, p, max_tokens, default_max, what)
        for j in range(body.n):
            subs.append(Submission(p, sampling_params(body, mt, j), want_logprobs))
            meta.append(i * body.n + j)
    queue: asyncio.Queue = asyncio.Queue()
    arrival = time.perf_counter()
    rids = await state.submit(subs, queue)
    state.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
    choices = {rid: Choice(idx, rid, TextStream(state.llm.tokenizer, body.stop_strings()))
               for rid, idx in zip(rids, meta)}  # fmt: skip
    include = bool(body.stream_options and body.stream_options.include_usage)
    ids = body.return_token_ids or state.llm.tokenizer is None
    return GenerationJob(state, kind, model, prompts, choices, queue, arrival, want_logprobs, include, ids)


# ---- responses ---------------------------------------------------------------------------
async def wait_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body is already read, so only a disconnect comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def whole_response(job: GenerationJob, request: Request) -> Response:
    async def collect() -> None:
        while not all(c.done for c in job.choices.values()):
            job.absorb(await job.queue.get())

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
        job.abort_unfinished()
    if not work.done() or work.cancelled():
        return Response(status_code=499)  # nobody is listening; the engine requests are aborted
    work.result()  # re-raises an APIError from the engine
    return JSONResponse(job.final_body())


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EngineStream(StreamingResponse):
    """An SSE response that aborts its unfinished engine requests however it ends (done,
    client gone, server shutting down)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def stream_response(job: GenerationJob) -> Response:
    async def events() -> AsyncIterator[bytes]:
        sent = {rid: 0 for rid in job.choices}
        pending_lp: dict[str, list[TokenLogprob]] = {rid: [] for rid in job.choices}
        pending_ids: dict[str, list[int]] = {rid: [] for rid in job.choices}
        if job.kind == "chat":  # the role first, as OpenAI and vLLM do
            for c in sorted(job.choices.values(), key=lambda c: c.index):
                yield _sse(job.chunk(c, "", [], 0))
        failed = False
        while not failed and not all(c.done for c in job.choices.values()):
            items = [await job.queue.get()]
            while not job.queue.empty():  # a client behind the engine gets what is queued in one chunk
                items.append(job.queue.get_nowait())
            deltas: dict[str, str] = {}
            order: list[Any] = []
            for item in items:
                try:
                    c, delta, fresh = job.absorb(item)
                except APIError as e:
                    yield _sse(e.body())
                    failed = True
                    break
                if not fresh:
                    continue
                if c.rid not in deltas:
                    order.append(c)
                deltas[c.rid] = deltas.get(c.rid, "") + delta
                pending_lp[c.rid].extend(item.logprobs)
                pending_ids[c.rid].extend(item.output.new_token_ids)
            if failed:
                break
            for c in order:
                delta = deltas[c.rid]
                if delta or c.done or (job.token_ids and pending_ids[c.rid]):
                    records = pending_lp[c.rid] if job.want_logprobs is not None else []
                    yield _sse(job.chunk(c, delta, records, sent[c.rid], pending_ids[c.rid]))
                    sent[c.rid] += len(delta)
                    pending_lp[c.rid], pending_ids[c.rid] = [], []
        if job.stream_usage:
            obj = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
            yield _sse({"id": job.obj_id, "object": obj, "created": job.created, "model": job.model, "choices": [],
                        "usage": job.usage()})  # fmt: skip
        yield b"data: [DONE]\n\n"

    return EngineStream(events(), job.abort_unfinished)
