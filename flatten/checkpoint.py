"""A checkpoint's weights bound to the HF model as memory maps of its safetensors files (issue 20).

``from_pretrained(dir)`` builds the model on the meta device, then reads every tensor into a
fresh buffer (``tensor[...]``): the whole model is copied into anonymous memory before capture
starts, and its pages can never be given back. Here the same loader is handed a state dict of
tensors memory-mapped by ``safetensors.safe_open``: transformers still builds the skeleton on
meta, renames and converts keys with its own conversion mapping (fused MoE experts are the
converted ones, made by torch.stack/cat), recomputes the buffers the checkpoint does not hold
(rotary inv_freq, position ids) on the CPU and reports missing, unexpected and mismatched keys;
but a tensor whose name, dtype and shape already match is bound as the mapped tensor itself.
Capture, the self-check, the reference and the artifact writer then read the weights from the
page cache (copy-on-write: nothing is ever written back to the checkpoint), so the process
holds no second copy and the kernel may drop the pages under memory pressure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Binding:
    """How a loaded module's tensors relate to its checkpoint (recorded in graph.meta)."""

    mapped: int  # parameters that are the checkpoint's memory-mapped tensors (no copy)
    copied: int  # parameters transformers converted (dtype cast, fused experts): real copies
    buffers: int  # buffers made on the CPU by the model's own init (not in the checkpoint)
    mapped_bytes: int
    copied_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"weights": "memory-mapped safetensors", "mapped_tensors": self.mapped, "copied_tensors": self.copied,
                "recomputed_buffers": self.buffers, "mapped_bytes": self.mapped_bytes,
                "copied_bytes": self.copied_bytes}


def checkpoint_files(p: Path) -> list[Path]:
    """The safetensors files from_pretrained would read: the index's shards, else model.safetensors
    (other *.safetensors beside it, such as a GGUF source's native blocks, are not the model's);
    empty when neither is there (transformers' own loader then decides)."""
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            doc = json.loads(index.read_text(encoding="utf-8"))
            names = sorted(set(doc["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            from portlayer.flatten.capture import CaptureError

            raise CaptureError(f"{index}: not a safetensors index ({type(e).__name__}: {str(e)[:200]}); "
                               "re-save the model with save_pretrained()") from None
        missing = [n for n in names if not (p / n).is_file()]
        if missing:
            from portlayer.flatten.capture import CaptureError

            raise CaptureError(f"{index} lists shards that are not in {p}: {', '.join(missing[:5])}; "
                               "copy the missing files")
        return [p / n for n in names]
    single = p / "model.safetensors"
    return [single] if single.is_file() else []


def mapped_state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of ``files``, memory-mapped (safe_open reads no tensor data)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if name in out:
                    from portlayer.flatten.capture import CaptureError

                    raise CaptureError(f"tensor {name!r} is stored twice ({f} and an earlier shard); "
                                       "the checkpoint's shards do not belong together")
                out[name] = st.get_tensor(name)
    return out


def model_class(auto_cls: Any, config: Any) -> Any:
    """The concrete class an Auto class picks for ``config`` (from_pretrained(None, ...) needs it)."""
    return auto_cls._model_mapping[type(config)]


def load_mapped(model_cls: Any, config: Any, files: list[Path], kwargs: dict[str, Any]) -> tuple[torch.nn.Module, Any, Binding]:
    """(model, loading info, Binding): ``from_pretrained`` on the memory-mapped state dict.

    Raises ValueError (a CaptureError upstream) when a tensor is left on the meta device:
    a buffer transformers could not recompute must never reach capture as a shape without a value.
    """
    state = mapped_state_dict(files)
    storages = {t.untyped_storage().data_ptr() for t in state.values() if t.numel()}
    model, info = model_cls.from_pretrained(None, config=config, state_dict=state, **kwargs)
    del state
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if on_meta:
        raise ValueError(f"tensors left on the meta device after loading: {', '.join(on_meta[:10])}")
    mapped = copied = mapped_b = copied_b = 0
    for t in {id(t): t for t in model.parameters()}.values():
        n = t.numel() * t.element_size()
        if t.numel() and t.untyped_storage().data_ptr() in storages:
            mapped, mapped_b = mapped + 1, mapped_b + n
        else:
            copied, copied_b = copied + 1, copied_b + n
    computed = sum(1 for b in model.buffers() if not (b.numel() and b.untyped_storage().data_ptr() in storages))
    return model, info, Binding(mapped, copied, computed, mapped_b, copied_b)
