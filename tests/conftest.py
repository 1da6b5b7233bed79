"""Shared fixtures: tiny random-weight HF models saved with save_pretrained (nothing downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# GPU-target compiles in tests ship kernel sources only (no cubin/hsaco/SPIR-V build, seconds each);
# tests/test_binaries.py and tests/test_xpu_spirv.py ask for binaries explicitly (sources_only=False).
os.environ.setdefault("PORTLAYER_SOURCES_ONLY", "1")
if not torch.cuda.is_available() and "triton.language" not in __import__("sys").modules:
    # Without a GPU the Triton tier runs in the interpreter, and Triton fixes interpreted-or-
    # compiled at its first import: set it before any test module imports a kernel. The AOT
    # and GPU tiers run in subprocesses without it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gpt2", "tiny-bert"]


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep the content-addressed cache and materialised models out of ~/.cache."""
    if "PORTLAYER_CACHE" not in os.environ:
        os.environ["PORTLAYER_CACHE"] = str(tmp_path_factory.mktemp("portlayer-cache"))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from portlayer.builtin_models import materialize_tiny

    root = tmp_path_factory.mktemp("tiny-models")
    return {name: materialize_tiny(name, directory=root / name) for name in TINY_ARCHS}


@pytest.fixture(scope="session")
def captured(tiny_dirs: dict[str, Path]):
    """Each tiny model captured once per session (graphs are never mutated by tests)."""
    from portlayer.flatten import capture

    return {name: capture(path) for name, path in tiny_dirs.items()}


def hf_model(path: Path):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(path))
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in (cfg.architectures or []))
    cls = AutoModelForCausalLM if causal else AutoModel
    return cls.from_pretrained(str(path), attn_implementation="eager").eval()


def hf_forward(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids[None])
    return (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state)[0]


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    from portlayer.builtin_models import minilm_path

    return minilm_path()
