"""Bad input, part 4: the command line. A user error exits 2 with one message and no traceback;
an internal bug keeps its traceback and asks for a report; a closed pipe is quiet; every verb
describes itself; the issue's cases (encoder on Ascend, explain GPT-2, inspect --after bogus,
tokenizer-less artifacts, corrupt models) end in the right outcome."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bad_input_samples import compile_sample, tree

from portlayer.cli import EXIT_BROKEN_PIPE, build_parser, main


@pytest.fixture
def env(tmp_path: Path, monkeypatch) -> dict[str, str]:
    monkeypatch.setenv("PORTLAYER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PORTLAYER_FINGERPRINT", "bad-inputs-cli")
    return dict(os.environ)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def user_error(capsys, *args: str) -> str:
    rc, _out, err = cli(capsys, *args)
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if not ln.startswith("[portlayer] ")]  # progress lines may precede it
    assert "Traceback" not in err and lines[0].startswith(f"portlayer {args[0]}: error: "), err
    assert sum(ln.startswith("portlayer ") for ln in lines) == 1, err
    return "\n".join(lines)


def _verbs() -> list[str]:
    import argparse

    out = []
    for name, p in build_parser()._subparsers._group_actions[0].choices.items():
        out.append(name)
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                out += [f"{name} {n}" for n in a.choices]
    return out


# ---- the CLI contract --------------------------------------------------------------------------
def test_version(capsys) -> None:
    from portlayer import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"portlayer {__version__}"


@pytest.mark.parametrize("verb", _verbs())
def test_every_verb_has_a_description(capsys, verb: str) -> None:
    with pytest.raises(SystemExit):
        main([*verb.split(), "--help"])
    text = capsys.readouterr().out
    usage, _, rest = text.partition("\n\n")
    assert usage.startswith(f"usage: portlayer {verb}")
    assert rest.strip() and not rest.lstrip().startswith(("positional arguments", "options")), text


def test_inspect_help_lists_the_pass_names(capsys) -> None:
    from portlayer.passes.pipeline import pass_names

    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "passes in order: " + ", ".join(pass_names()) in text


def test_inspect_after_bogus_is_one_message(capsys) -> None:
    from portlayer.passes.pipeline import pass_names

    err = user_error(capsys, "inspect", "no-model-needed", "--target", "cpu-x86_64", "--after", "bogus")
    assert err.strip() == ("portlayer inspect: error: --after 'bogus' is not a pass; passes in order: "
                           + ", ".join(pass_names()))


def test_inspect_after_without_target(capsys) -> None:
    assert "--after and --dump-passes need --target" in user_error(capsys, "inspect", "m", "--after", "fuse")


def test_internal_bug_keeps_the_traceback_and_asks_for_a_report(capsys, monkeypatch) -> None:
    import portlayer.cli_capabilities as cc

    def boom(_args):
        raise KeyError("hidden_size")

    monkeypatch.setattr(cc, "cmd_devices", boom)
    rc, _out, err = cli(capsys, "devices")
    assert rc == 1 and "Traceback (most recent call last)" in err and "KeyError: 'hidden_size'" in err
    assert err.rstrip().splitlines()[-1].startswith("portlayer devices: internal error (KeyError); this is a bug")


@pytest.mark.parametrize("exc,pattern", [
    (lambda: __import__("portlayer.errors", fromlist=["x"]).UsageError("--foo 3 is not allowed; use 1 or 2"),
     "--foo 3 is not allowed; use 1 or 2"),
    (lambda: PermissionError(13, "Permission denied", "/srv/out/plan.json"), "Permission denied: '/srv/out/plan.json'"),
    (lambda: __import__("portlayer.capabilities.descriptor", fromlist=["x"]).DescriptorError(
        "x.json", "memory.bandwidth_gbps", "finite", "NaN is not a number"), "x.json: memory.bandwidth_gbps: finite"),
])  # fmt: skip
def test_user_errors_derive_from_one_base_and_exit_2(capsys, monkeypatch, exc, pattern: str) -> None:
    import portlayer.cli_capabilities as cc

    def fail(_args):
        raise exc()

    monkeypatch.setattr(cc, "cmd_devices", fail)
    err = user_error(capsys, "devices")
    assert pattern in err and len(err.strip().splitlines()) == 1


def test_broken_pipe_is_quiet(capsys, monkeypatch) -> None:
    class ClosedPipe:
        def write(self, _s):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            return os.open(os.devnull, os.O_WRONLY)

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["devices"]) == EXIT_BROKEN_PIPE
    assert "Traceback" not in capsys.readouterr().err


def test_broken_pipe_in_a_real_process(env) -> None:
    """A reader that has gone before portlayer writes (`portlayer ... | head -0`): quiet, status 141."""
    p = subprocess.Popen([sys.executable, "-m", "portlayer.cli", "cache", "list"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # long before the interpreter has imported portlayer
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == EXIT_BROKEN_PIPE and err == "", err


# ---- the cases -------------------------------------------------------------------------
def test_encoder_compiles_for_ascend_and_validates_on_the_emulator(tiny_dirs, env, tmp_path: Path, capsys) -> None:
    out = tmp_path / "bert-910b"
    rc, _o, err = cli(capsys, "compile", str(tiny_dirs["tiny-bert"]), "--target", "ascend-910b", "-o", str(out),
                      "--no-progress")
    assert rc == 0, err
    rc, o, err = cli(capsys, "validate", str(out), "--emulate-ascend")
    assert rc == 0 and "PASSED" in o, o + err


def test_explain_gpt2_captures_when_config_is_not_llama_style(tiny_dirs, env, capsys) -> None:
    rc, out, err = cli(capsys, "explain", str(tiny_dirs["tiny-gpt2"]), "--target", "nvidia-h200", "--json")
    assert rc == 0, err
    plan = json.loads(out)
    n_embd = json.loads((tiny_dirs["tiny-gpt2"] / "config.json").read_text())["n_embd"]
    assert plan and n_embd and "Traceback" not in err


@pytest.fixture
def model_copy(tiny_dirs, tmp_path: Path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(tiny_dirs["tiny-qwen3"], d)
    return d


@pytest.mark.parametrize("damage,pattern", [
    ("truncated", r"model\.safetensors: not a readable safetensors file"),
    ("config", r"config\.json: not valid JSON"),
    ("model_type", r"config\.json: model_type 'qwen99' cannot be loaded"),
])  # fmt: skip
def test_damaged_model_dir_is_one_message(model_copy: Path, env, capsys, damage: str, pattern: str) -> None:
    import re

    if damage == "truncated":
        w = model_copy / "model.safetensors"
        w.write_bytes(w.read_bytes()[:1000])
    elif damage == "config":
        (model_copy / "config.json").write_text("{'single': 'quotes'}")
    else:
        cfg = json.loads((model_copy / "config.json").read_text())
        (model_copy / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen99"}))
    for verb in (["compile", str(model_copy), "--target", "cpu-x86_64", "--no-progress"],
                 ["inspect", str(model_copy)]):
        assert re.search(pattern, user_error(capsys, *verb))
    if damage == "config":  # explain reads config.json itself (it needs no weights)
        assert re.search(pattern, user_error(capsys, "explain", str(model_copy)))


def test_compile_output_over_a_foreign_dir_keeps_it(env, capsys, tmp_path: Path) -> None:
    from artifact_samples import sample_graph

    from portlayer.flatten.serialize import save_graph

    save_graph(sample_graph(), tmp_path / "g")
    site = tmp_path / "site"
    site.mkdir()
    (site / "manifest.json").write_text('{"name": "my web app"}')
    (site / "app.js").write_text("console.log(1)")
    before = tree(site)
    err = user_error(capsys, "compile", str(tmp_path / "g"), "--target", "cpu-x86_64", "-o", str(site), "--no-progress")
    assert "is not a portlayer artifact" in err and tree(site) == before


@pytest.mark.parametrize("args,pattern", [
    (["compile", "no-such-model", "--no-progress"], "is neither a local directory, a built-in example"),
    (["validate", "/nonexistent/art"], "no such artifact directory"),
    (["bench", "/nonexistent/art"], "no such artifact directory"),
    (["run", "/nonexistent/art", "--prompt-ids", "1"], "is neither a local directory, a built-in example"),
])  # fmt: skip
def test_missing_inputs_are_one_message(env, capsys, args: list[str], pattern: str) -> None:
    assert pattern in user_error(capsys, *args)


# ---- tokenizer-less artifacts ----------------------------------------------------------------
@pytest.fixture(scope="module")
def no_tok(tiny_dirs, tmp_path_factory) -> tuple[Path, Path]:
    """tiny-qwen3 saved without tokenizer files (its artifact's tokenizer/ holds only generation_config.json)."""
    root = tmp_path_factory.mktemp("no-tok")
    d = root / "model"
    shutil.copytree(tiny_dirs["tiny-qwen3"], d)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / f).unlink(missing_ok=True)
    (d / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PORTLAYER_CACHE", str(root / "cache"))
        mp.setenv("PORTLAYER_FINGERPRINT", "no-tok")
        assert main(["compile", str(d), "--target", "cpu-x86_64", "-o", str(root / "art"), "--no-progress"]) == 0
    return d, root / "art"


def test_prompt_ids_run_without_a_tokenizer(no_tok, env, capsys) -> None:
    from conftest import hf_model

    d, art = no_tok
    assert sorted(json.loads((art / "manifest.json").read_text())["files"]).count("tokenizer/generation_config.json")
    rc, out, err = cli(capsys, "run", str(art), "--prompt-ids", "5,6,7", "--max-tokens", "4", "--ignore-eos", "--json")
    assert rc == 0, err
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        ref = hf_model(d).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)[0, 3:].tolist()
    assert json.loads(out)["token_ids"] == ref


@pytest.mark.parametrize("args,pattern", [
    (["--prompt", "hello"], "has no tokenizer .* --prompt TEXT cannot be encoded; pass token ids instead: --prompt-ids"),
    (["--prompt-ids", "1,x"], "--prompt-ids '1,x': expected comma-separated integers"),
    (["--prompt-ids", "999999"], "token id 999999 is outside"),
    (["--prompt-ids", "1", "--temperature", "nan"], "sampling parameter temperature=nan must be a finite number"),
    (["--prompt-ids", "1", "--top-p", "0"], r"top_p must be in \(0, 1\]"),
])  # fmt: skip
def test_run_refusals(no_tok, env, capsys, args: list[str], pattern: str) -> None:
    import re

    assert re.search(pattern, user_error(capsys, "run", str(no_tok[1]), *args))


def test_embed_on_a_causal_artifact_is_refused(no_tok, env, capsys) -> None:
    assert "has no tokenizer" in user_error(capsys, "embed", str(no_tok[1]), "--text", "hi")


# ---- the cache ---------------------------------------------------------------------------------
def test_cache_clear_that_cannot_remove_says_so_and_keeps_entries(env, capsys, tmp_path: Path, monkeypatch) -> None:
    from portlayer.runtime import cache

    cached = compile_sample(None)  # into the cache
    before = tree(cached)

    def deny(src, dst):
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr(cache.os, "rename", deny)
    err = user_error(capsys, "cache", "clear")
    assert "removed 0 cached artifact(s)" in err and "could not be removed" in err and "Permission denied" in err
    assert tree(cached) == before
    monkeypatch.undo()
    monkeypatch.setenv("PORTLAYER_CACHE", env["PORTLAYER_CACHE"])
    rc, out, _ = cli(capsys, "cache", "clear")
    assert rc == 0 and out.startswith("removed 1 cached artifact(s)") and not cached.exists()
