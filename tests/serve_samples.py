"""Shared pieces of the serving tests: a tiny chat-capable CPU artifact and servers on 127.0.0.1.

The tiny models have no chat template, so the artifact is compiled from a copy of
tiny-qwen3 with one added (tokenizer/chat_template.jinja travels into the artifact).
Compiles go through the content-addressed cache, so every test module after the first
gets the artifact for free.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip


def chat_model_dir(root: Path) -> Path:
    from portlayer.builtin_models import materialize_tiny

    src = materialize_tiny("tiny-qwen3", directory=root / "tiny-qwen3")
    dst = root / "tiny-qwen3-chat"
    if not dst.exists():
        shutil.copytree(src, dst)
        (dst / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return dst


def chat_artifact(root: Path) -> Path:
    import portlayer

    return portlayer.compile(chat_model_dir(root), target="cpu-x86_64", progress=False).path


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Tiny CPU models run ~30x faster on one intra-op thread on a shared 2-core machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def serving(engine: Any, names: tuple[str, ...] = ("tiny",), **kw: Any) -> Iterator[Any]:
    from portlayer.runtime.serve import ServerThread, build_app

    with ServerThread(build_app(engine, list(names), **kw)) as server:
        yield server


def client(server: Any, api_key: str = "unused", **kw: Any) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)


@contextlib.contextmanager
def process_serving(art: Any, names: tuple[str, ...] = ("tiny",), engine_kwargs: dict | None = None,
                    **kw: Any) -> Iterator[Any]:  # fmt: skip
    """``serving`` with the engine in its own process (``ProcessEngine``); the child must be gone afterwards."""
    from portlayer.runtime.serve import ServerThread, build_app
    from portlayer.runtime.serve.process_engine import ProcessEngine

    core = ProcessEngine(str(art), dict(engine_kwargs or {"max_num_seqs": 16}), torch_threads=1,
                         max_queue_len=kw.pop("max_queue_len", 1024))  # fmt: skip
    try:
        with ServerThread(build_app(core, list(names), **kw)) as server:
            server.core = core
            yield server
    finally:
        core.close()
    assert core.proc.poll() is not None, f"engine process {core.proc.pid} outlived its server"
