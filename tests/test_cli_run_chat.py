"""``portlayer run`` with several prompts, --chat, --stream, --stop, and HF-cache model ids, against HF generate."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from serve_samples import chat_artifact, chat_model_dir, one_torch_thread

from portlayer.cli import main


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("cli-run")


@pytest.fixture(scope="module")
def art(root):
    with one_torch_thread():
        yield str(chat_artifact(root))


@pytest.fixture(scope="module")
def hf(root):
    from conftest import hf_model
    from transformers import AutoTokenizer

    d = chat_model_dir(root)
    return hf_model(d), AutoTokenizer.from_pretrained(str(d))


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    t = torch.tensor([ids])
    out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


def run_json(capsys, *argv: str) -> list[dict]:
    assert main(["run", *argv, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_several_prompts_and_chat_match_hf(art, hf, capsys):
    model, tok = hf
    prompts = ["first prompt", "second, longer prompt"]
    outs = run_json(capsys, art, "--prompt", prompts[0], "--prompt", prompts[1], "--max-tokens", "6", "--ignore-eos")
    assert [o["token_ids"] for o in outs] == [hf_greedy(model, tok(p)["input_ids"], 6) for p in prompts]
    assert [o["text"] for o in outs] == [tok.decode(o["token_ids"]) for o in outs]
    chat = run_json(capsys, art, "--chat", "--prompt", "hi there", "--max-tokens", "6", "--ignore-eos")
    ids = tok.apply_chat_template([{"role": "user", "content": "hi there"}], add_generation_prompt=True,
                                  tokenize=True)["input_ids"]  # fmt: skip
    assert chat[0]["token_ids"] == hf_greedy(model, ids, 6)


def test_stream_and_stop(art, hf, capsys):
    model, tok = hf
    ids = hf_greedy(model, tok("stop me")["input_ids"], 20)
    full = tok.decode(ids)
    assert main(["run", art, "--prompt", "stop me", "--max-tokens", "20", "--ignore-eos", "--stream"]) == 0
    assert capsys.readouterr().out == full + "\n"
    stop = full[7:9]
    out = run_json(capsys, art, "--prompt", "stop me", "--max-tokens", "20", "--ignore-eos", "--stop", stop)[0]
    assert out["text"] == full[: full.find(stop)] and out["finish_reason"] == "stop" and out["stop_reason"] == stop
    assert main(["run", art, "--prompt", "stop me", "--max-tokens", "20", "--ignore-eos", "--stream", "--stop", stop]) == 0
    assert capsys.readouterr().out == full[: full.find(stop)] + "\n"


def test_hf_cache_model_id(root, hf, capsys, monkeypatch):
    model, _ = hf
    hub = root / "hf-home" / "hub"
    repo = hub / "models--acme--tiny-chat"
    commit = "0123456789abcdef0123456789abcdef01234567"
    chat_model_dir(root)
    shutil.copytree(root / "tiny-qwen3", repo / "snapshots" / commit)  # the same weights, no chat template
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(root / "hf-home"))
    out = run_json(capsys, "acme/tiny-chat", "--prompt-ids", "4,8,15,16", "--max-tokens", "5", "--ignore-eos")
    assert out[0]["token_ids"] == hf_greedy(model, [4, 8, 15, 16], 5)
    assert main(["run", "acme/tiny-chat", "--chat", "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "no chat template" in err and "Traceback" not in err
    assert main(["run", "acme/not-there", "--prompt-ids", "1", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert str(hub) in err and "Traceback" not in err
