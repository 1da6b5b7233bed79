"""`portlayer compile | validate | bench | cache`: messages, exit codes, and no tracebacks for user errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from artifact_samples import sample_graph

from portlayer.cli import main


@pytest.fixture
def env(tmp_path: Path, monkeypatch) -> dict[str, str]:
    monkeypatch.setenv("PORTLAYER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PORTLAYER_FINGERPRINT", "cli-test")  # others may edit sources between two runs
    return dict(os.environ)


@pytest.fixture
def graph_dir(tmp_path: Path) -> Path:
    from portlayer.flatten.serialize import save_graph

    return save_graph(sample_graph(), tmp_path / "graph")


def test_compile_then_cache_hit_validate_bench(env, graph_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["compile", str(graph_dir), "--target", "cpu-x86_64", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "compiled" in out and "next: portlayer validate" in out
    art = Path(out.split("artifact: ")[1].split()[0])

    assert main(["compile", str(graph_dir), "--target", "cpu-x86_64", "--no-progress"]) == 0
    assert "cache hit" in capsys.readouterr().out

    assert main(["validate", str(art), "--json", str(tmp_path / "v.json")]) == 0
    assert "PASSED" in capsys.readouterr().out
    assert json.loads((tmp_path / "v.json").read_text())["ok"] is True

    assert main(["bench", str(art), "--json", str(tmp_path / "b.json"), "--iters", "2", "--batch", "1", "2",
                 "--prefill-tokens", "16", "--context", "8"]) == 0
    out = capsys.readouterr().out
    assert "prefill" in out and "decode   batch   2" in out
    r = json.loads((tmp_path / "b.json").read_text())
    assert r["prefill"]["tokens_per_s"] > 0 and [d["batch"] for d in r["decode"]] == [1, 2]

    assert main(["cache", "list"]) == 0
    assert art.name in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert "removed 1 cached artifact" in capsys.readouterr().out


def test_user_errors_exit_2_with_one_message(env, graph_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["compile", str(graph_dir), "--target", "cpu-x86_64", "--dtype", "float8", "--no-progress"]) == 2
    assert "--dtype 'float8' is not supported" in capsys.readouterr().err
    assert main(["compile", "no-such-model", "--no-progress"]) == 2
    assert "is neither a local directory, a built-in example" in capsys.readouterr().err
    assert main(["compile", str(graph_dir), "--target", "no-such-device", "--no-progress"]) == 2
    assert "no shipped descriptor named 'no-such-device'" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "missing")]) == 2
    assert "no such artifact directory" in capsys.readouterr().err


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "portlayer.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_damaged_artifacts_in_a_real_process_print_no_traceback(env, graph_dir: Path, tmp_path: Path) -> None:
    import portlayer

    good = portlayer.compile(graph_dir, target="cpu-x86_64", output=tmp_path / "a", progress=False).path
    h200 = portlayer.compile(graph_dir, target="nvidia-h200", output=tmp_path / "h", progress=False).path
    (good / "plan.json").write_text("{broken")
    (h200 / "manifest.json").write_text("{broken")
    p = _cli(["validate", str(good)], env)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "plan.json (plan): " in p.stderr and "modified" in p.stderr
    p = _cli(["bench", str(h200)], env)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "manifest.json: not valid JSON" in p.stderr


def test_wrong_device_in_a_real_process(env, graph_dir: Path, tmp_path: Path) -> None:
    import torch

    import portlayer

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    art = portlayer.compile(graph_dir, target="nvidia-h200", output=tmp_path / "h", progress=False).path
    p = _cli(["validate", str(art)], env)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "expected: a device with arch sm_90 and codegen triton (cuda)" in p.stderr
    assert f"portlayer compile {graph_dir} --target cpu-x86_64" in p.stderr
