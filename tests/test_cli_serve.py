"""``portlayer serve`` as a user runs it: a subprocess on 127.0.0.1, an API key, graceful SIGTERM."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from serve_samples import chat_artifact, one_torch_thread

from portlayer.cli import main


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    with one_torch_thread():
        yield str(chat_artifact(tmp_path_factory.mktemp("cli-serve")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_busy_port_is_a_clear_error(art, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert main(["serve", art, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--port" in err and "Traceback" not in err


def test_bad_artifact_in_process_mode_is_a_clear_error(art, tmp_path, capfd):
    bad = tmp_path / "bad"
    shutil.copytree(art, bad)
    (bad / "weights.safetensors").write_bytes(b"\0" * 64)  # damaged: its sha256 no longer matches the manifest
    assert main(["serve", str(bad), "--port", str(free_port()), "--engine-core", "process"]) == 2
    err = capfd.readouterr().err
    assert "weights.safetensors" in err and "Traceback" not in err, err[-2000:]


def test_serve_subprocess_streams_and_drains_on_sigterm(art):
    """In process mode (the GPU default): uvicorn's drain, then the engine process stops with the server.
    Thread mode's shutdown (the CPU default) runs at the end of every in-process server of the other tests."""
    core = "process"
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "portlayer.cli", "serve", art, "--port", str(port), "--api-key", "k",
           "--served-model-name", "tiny", "--shutdown-timeout", "30", "--log-level", "warning",
           "--engine-core", core]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up in 90 s"
            time.sleep(0.2)
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
        body = {"model": "tiny", "prompt": "drain me", "max_tokens": 40, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            proc.send_signal(signal.SIGTERM)  # in flight: uvicorn lets it finish before exiting
            events += [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 40
        # uvicorn re-raises the captured signal once it has shut down, so the exit status is the signal's
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        err = proc.stderr.read()
        assert "Traceback" not in err and "serving 'tiny'" in err
        if core == "process":  # the engine process went with the server: no orphan
            pid = int(re.search(r"engine process (\d+)", err).group(1))
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
