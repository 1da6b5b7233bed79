"""GGUF files as a model source: ``portlayer compile model.gguf`` (or a directory holding one).

A .gguf file is turned once into a Hugging Face directory under the cache, keyed by the
file's sha256, so everything downstream (capture, tokenizer, chat template, artifact
cache) sees an ordinary model directory:

- config.json and the tokenizer (tokenizer.json, tokenizer_config.json with the chat
  template) through transformers' own GGUF readers (``from_pretrained(gguf_file=...)``),
  which build them from the file's metadata with the ``gguf`` and ``tokenizers`` packages;
- model.safetensors: every tensor dequantized to float32 (``gguf.quants.dequantize``),
  named as transformers names it (``gguf.get_tensor_name_map``), llama's Q/K rows
  un-permuted as transformers' GGUF loader does;
- gguf_native.safetensors + gguf_native.json: the Q8_0 / Q4_0 / Q4_1 linear weights in
  their shipped blocks as linear_wq tensors (flatten/gguf_blocks.py), which the quantize
  pass uses under ``weight_quantization = "native"`` so the model runs with its authors' numbers.

Nothing from the file is evaluated: metadata is read as data, weights as arrays.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from portlayer.flatten.capture import CaptureError
from portlayer.flatten.gguf_blocks import NATIVE_FORMATS, NativeWeight, decode

NATIVE_FILE = "gguf_native.safetensors"
NATIVE_INDEX = "gguf_native.json"
#: gguf architectures whose Q/K weights llama.cpp's converter permuted (transformers un-permutes the same set)
PERMUTED_QK = ("llama",)


class GGUFError(CaptureError):
    """A .gguf source cannot be used; the message says which file and what to do."""


def find_gguf(path: Path) -> Path | None:
    """The .gguf file ``path`` names: itself, or the single one in a directory without config.json."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise GGUFError(f"{path} holds {len(files)} .gguf files ({', '.join(f.name for f in files)}); pass one of them")
    return files[0] if files else None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _cache_root() -> Path:
    return Path(os.environ.get("PORTLAYER_CACHE", Path.home() / ".cache" / "portlayer"))


def materialize_gguf(gguf_path: Path, say: Any = None) -> Path:
    """The HF directory for ``gguf_path`` (built on first use, then reused from the cache)."""
    sha = file_sha256(gguf_path)
    target = _cache_root() / "models" / f"gguf-{sha[:24]}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_hf_dir(gguf_path, tmp, sha)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _hf_config(gguf_path: Path) -> Any:
    import transformers
    from transformers.models.auto import modeling_auto

    transformers.logging.set_verbosity_error()
    try:
        config = transformers.AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError) as e:
        raise GGUFError(f"{gguf_path}: transformers cannot build a config from this file's metadata ({e}); "
                        "convert it to a Hugging Face directory with the tool that made it") from None
    if not getattr(config, "architectures", None):
        cls = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if cls:
            config.architectures = [cls]
    return config


def _name_map(arch: str, config: Any) -> dict[str, str]:
    """gguf tensor name -> transformers state-dict name, from an empty (meta) model's keys."""
    import gguf
    import transformers

    enum = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if enum is None:
        raise GGUFError(f"gguf {gguf.__version__} does not know the architecture {arch!r}")
    names = gguf.get_tensor_name_map(enum, int(config.num_hidden_layers))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    out = {}
    for key in model.state_dict():
        stem, _, suffix = key.rpartition(".")
        g = names.get_name(stem)
        if g is not None:
            out[f"{g}.{suffix}"] = key
    return out


def _unpermute_index(rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's ``permute(w, n_head)`` (rows = heads x 2 x dim/2)."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(rows)


def _write_hf_dir(gguf_path: Path, out: Path, sha: str) -> None:
    import gguf
    import transformers
    from safetensors.torch import save_file

    config = _hf_config(gguf_path)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    reader = gguf.GGUFReader(str(gguf_path))
    arch = str(reader.fields["general.architecture"].contents())
    mapping = _name_map(arch, config)
    heads, kv_heads = int(config.num_attention_heads), int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    dense: dict[str, torch.Tensor] = {}
    native: dict[str, torch.Tensor] = {}
    index: dict[str, dict[str, Any]] = {}
    for t in reader.tensors:
        hf = mapping.get(t.name)
        if hf is None:
            if t.name.startswith("rope_freqs"):  # precomputed rope factors: transformers recomputes them
                continue
            raise GGUFError(f"{gguf_path}: tensor {t.name!r} has no transformers counterpart in {config.model_type}")
        fmt = t.tensor_type.name
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims fastest first
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float().reshape(shape)
        perm = None
        if arch in PERMUTED_QK and (".attn_q." in t.name or ".attn_k." in t.name):
            perm = _unpermute_index(shape[0], heads if ".attn_q." in t.name else kv_heads)
            w = w[perm]
        dense[hf] = w.contiguous()
        if fmt in NATIVE_FORMATS and len(shape) == 2 and not t.name.startswith("token_embd"):
            nw = decode(fmt, t.data, shape[0], shape[1])
            nw = nw.permute_rows(perm) if perm is not None else nw
            native[f"{hf}.qweight"], native[f"{hf}.scales"] = nw.qweight, nw.scales
            if nw.offsets is not None:
                native[f"{hf}.offsets"] = nw.offsets
            index[hf] = {"format": fmt, "bits": nw.bits, "group_size": nw.group_size, "offsets": nw.offsets is not None}
    if getattr(config, "tie_word_embeddings", False):
        dense = {k: v for k, v in dense.items() if k != "lm_head.weight"}
    config.save_pretrained(str(out))
    save_file(dense, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(out))
    if native:
        save_file(native, str(out / NATIVE_FILE))
    (out / NATIVE_INDEX).write_text(json.dumps({"source": str(gguf_path), "sha256": sha, "weights": index}, indent=1))


def native_index(model_dir: str | os.PathLike[str] | None) -> dict[str, dict[str, Any]]:
    """{transformers weight name: {format, bits, group_size}} of a materialized GGUF directory ({} otherwise)."""
    if not model_dir:
        return {}
    p = Path(model_dir) / NATIVE_INDEX
    if not p.is_file():
        return {}
    try:
        doc = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    w = doc.get("weights")
    return w if isinstance(w, dict) else {}


def native_summary(model_dir: str | os.PathLike[str] | None) -> str | None:
    """'Q4_1' (or 'Q4_1+Q8_0') when the model directory carries native blocks, else None."""
    fmts = sorted({str(v.get("format")) for v in native_index(model_dir).values()})
    return "+".join(fmts) if fmts else None


def load_native(model_dir: str | os.PathLike[str]) -> dict[str, NativeWeight]:
    """The native linear weights of a materialized GGUF directory, by transformers weight name."""
    from safetensors.torch import load_file

    idx = native_index(model_dir)
    if not idx:
        return {}
    t = load_file(str(Path(model_dir) / NATIVE_FILE))
    return {name: NativeWeight(str(m["format"]), int(m["bits"]), int(m["group_size"]), t[f"{name}.qweight"],
                               t[f"{name}.scales"], t.get(f"{name}.offsets")) for name, m in idx.items()}
