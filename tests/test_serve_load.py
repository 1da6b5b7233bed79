"""Load on loopback: many concurrent streaming clients, and clients that walk away mid-stream.

Bounded: 64 clients x 4 requests x 6 tokens, 16 disconnecting clients; every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch
from serve_samples import chat_artifact, one_torch_thread, serving

from portlayer.runtime.engine import LLMEngine
from portlayer.runtime.sequence import SamplingParams

CLIENTS, PER_CLIENT, MAX_TOKENS = 64, 4, 6


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    with one_torch_thread():
        yield chat_artifact(tmp_path_factory.mktemp("serve-load"))


@pytest.fixture(scope="module")
def srv(art):
    with one_torch_thread():
        eng = LLMEngine.from_artifact(art, max_num_seqs=64)
        with serving(eng) as s:
            s.llm = eng
            yield s


def disconnect_mid_stream(url: str, ps: list[list[int]]) -> list[int]:
    """Stream each prompt (400 tokens asked, EOS ignored) from its own client, which leaves after 3 chunks;
    the number of chunks each one read."""

    async def walk_away(c: openai.AsyncOpenAI, prompt: list[int]) -> int:
        stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=400, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})  # fmt: skip
        got = 0
        async for _chunk in stream:
            got += 1
            if got == 3:
                break
        await stream.close()
        return got

    async def main() -> list[int]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            return await asyncio.wait_for(asyncio.gather(*(walk_away(c, p) for p in ps)), timeout=120)

    return asyncio.run(main())


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(3, 24, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]  # fmt: skip


async def _stream_one(c: httpx.AsyncClient, prompt: list[int], tag: int) -> tuple[int, str, str | None, int]:
    """One streamed completion, SSE parsed by hand (the openai client's per-chunk cost doubles this test)."""
    text, finish, usage, done = [], None, None, False
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            ch = json.loads(line[6:])
            if ch["choices"]:
                text.append(ch["choices"][0]["text"])
                finish = ch["choices"][0]["finish_reason"] or finish
            if ch.get("usage"):
                usage = ch["usage"]["completion_tokens"]
    assert done
    return tag, "".join(text), finish, usage


def test_64_streaming_clients_x4_equal_offline_greedy(srv, art):
    ps = prompts(CLIENTS * PER_CLIENT)
    ref = LLMEngine.from_artifact(art, max_num_seqs=64)
    with one_torch_thread():
        want = [o.text for o in ref.generate(ps, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]

    async def client_task(c: httpx.AsyncClient, k: int) -> list[tuple[int, str, str | None, int]]:
        return [await _stream_one(c, ps[k * PER_CLIENT + i], k * PER_CLIENT + i) for i in range(PER_CLIENT)]

    async def main() -> list[tuple[int, str, str | None, int]]:
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=srv.url, limits=limits, timeout=120) as c:
            per = await asyncio.wait_for(asyncio.gather(*(client_task(c, k) for k in range(CLIENTS))), timeout=240)
        return [r for rs in per for r in rs]

    t0 = time.perf_counter()
    with one_torch_thread():
        results = asyncio.run(main())
    dt = time.perf_counter() - t0
    assert len(results) == CLIENTS * PER_CLIENT and sorted(r[0] for r in results) == list(range(len(ps)))
    wrong = [tag for tag, text, _, _ in results if text != want[tag]]
    assert not wrong, f"{len(wrong)} streams differ from offline greedy, e.g. request {wrong[0]}"
    assert all(fin == "length" and n == MAX_TOKENS for _, _, fin, n in results)
    bm = srv.llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not srv.llm.has_unfinished()
    print(f"[load] {len(results)} streams x {MAX_TOKENS} tokens in {dt:.1f} s")


def test_disconnecting_clients_free_the_kv_cache(srv):
    ps = prompts(16, seed=1)
    eng, bm = srv.llm, srv.llm.block_manager


    steps_before = eng.num_steps
    assert disconnect_mid_stream(srv.url, ps) == [3] * 16
    deadline = time.monotonic() + 20
    while (eng.has_unfinished() or bm.num_free_blocks != bm.num_blocks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not eng.has_unfinished() and not eng.scheduler.running and not eng.scheduler.waiting
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks still held"
    assert eng.num_steps - steps_before < 16 * 400 // 4, "the requests ran to completion instead of being aborted"
    assert not eng.requests


def _wait_all_free(eng, timeout: float = 20.0) -> None:
    bm, deadline = eng.block_manager, time.monotonic() + timeout
    while (eng.has_unfinished() or bm.num_free_blocks != bm.num_blocks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not eng.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def test_non_streaming_client_that_times_out_is_aborted(srv):
    eng = srv.llm
    steps_before = eng.num_steps
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    _wait_all_free(eng)
    assert eng.num_steps - steps_before < 480, "the request ran to completion instead of being aborted"


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(srv, monkeypatch):
    eng, failed = srv.llm, []
    real_step = eng.step

    def step_once_failing():
        if not failed:
            failed.append(True)
            raise RuntimeError("simulated device error")
        return real_step()

    monkeypatch.setattr(eng, "step", step_once_failing)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 500 and "simulated device error" in r.json()["error"]["message"]
    _wait_all_free(eng)
    r2 = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
    assert r2.status_code == 200 and r2.json()["usage"]["completion_tokens"] == 4


def test_abort_request_frees_blocks_wherever_the_request_is(art):
    eng = LLMEngine.from_artifact(art, max_num_seqs=2)
    bm, sp = eng.block_manager, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    first, second = eng.add_request(list(range(1, 40)), sp), eng.add_request([7] * 20, sp)
    waiting = eng.add_request([9] * 30, sp)  # max_num_seqs=2: stays in the waiting queue
    with one_torch_thread():
        eng.step()
    assert eng.requests[first].num_computed_tokens > 0 and eng.requests[waiting] in eng.scheduler.waiting
    assert bm.num_free_blocks < bm.num_blocks
    assert eng.abort_request(waiting) and eng.abort_request(first) and eng.abort_request(second)
    assert not eng.abort_request(first) and not eng.abort_request("no-such-request")
    assert bm.num_free_blocks == bm.num_blocks and not eng.has_unfinished() and not eng.requests
