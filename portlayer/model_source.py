"""What compile() was given, and its digest (the cache key's model half).

An HF directory's digest covers every byte of its model files (runtime/cache.model_dir_hash,
memoised by size, mtime, inode and ctime). A first compile of a big checkpoint has nothing
memoised: hashing it takes seconds (~10 s for 16 GB on the H200 host), so it runs in a helper
thread while the model is captured (`capture_while_hashing`), and the cache is asked once the
digest is known. A cached artifact can still match then (the same bytes at a new path or inode);
the capture is then discarded, which costs its time but never a wrong answer.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from portlayer.errors import PortlayerError

#: unmemoised model bytes from which hashing them runs beside the capture
OVERLAP_MIN_BYTES = 256 << 20


class CompileError(PortlayerError):
    """A compile option or model the user passed cannot be used as given."""


@dataclass
class ModelSource:
    spec: str
    path: Path | None
    sha256: str
    obj: Any = None  # an nn.Module or a Graph passed in memory, or the graph captured while hashing
    captured_beside_digest: bool = False  # obj is that graph; its capture stage ran (build.capture_while_hashing)


@dataclass
class PendingSource:
    """An HF directory whose digest is being computed in a helper thread (see the module docstring)."""

    spec: str
    path: Path
    digest: Future[str]

    def resolve(self, graph: Any) -> ModelSource:
        """The source with its digest (waits for it; re-raises what hashing raised) and the captured graph."""
        return ModelSource(self.spec, self.path, self.digest.result(), graph)


def model_source(model: Any) -> ModelSource | PendingSource:
    """The source and its digest; a PendingSource when an HF directory has at least
    OVERLAP_MIN_BYTES of files whose digest is not memoised (the digest then runs in a helper thread)."""
    import torch

    from portlayer.flatten.ir import Graph
    from portlayer.runtime.cache import model_dir_hash, tensors_hash

    if isinstance(model, Graph):
        from portlayer.flatten.serialize import graph_to_json

        return ModelSource("<in-memory graph>", None, tensors_hash(model.weights, graph_to_json(model)), model)
    if isinstance(model, torch.nn.Module):
        cfg = getattr(model, "config", None)
        extra = [type(model).__name__, cfg.to_json_string() if cfg is not None else None]
        return ModelSource(f"<in-memory {type(model).__name__}>", None, tensors_hash(model.state_dict(), extra), model)
    if not isinstance(model, (str, os.PathLike)):
        raise CompileError(f"compile() takes a model name, an HF directory, an nn.Module or a Graph, not {type(model).__name__}")
    from portlayer.builtin_models import resolve_model

    if str(model).lower().endswith(".onnx"):  # an ONNX file: capture() imports it (flatten/onnx_import.py)
        from portlayer.flatten.onnx_load import OnnxImportError, onnx_file_hash

        onnx_path = Path(model).expanduser()
        if not onnx_path.is_file():
            raise OnnxImportError(f"{onnx_path}: no such ONNX file")
        return ModelSource(str(model), onnx_path, onnx_file_hash(onnx_path))
    path = resolve_model(str(model))
    if (path / "graph.json").is_file() and not (path / "config.json").is_file():
        from portlayer.flatten.serialize import GraphFileError, load_graph
        from portlayer.flatten.verify import VerificationError, verify_graph

        try:  # a Flat IR graph saved with save_graph (e.g. by `portlayer inspect` or an ONNX import)
            graph = load_graph(path)
            verify_graph(graph)
        except GraphFileError as e:
            raise CompileError(f"{e}") from None
        except VerificationError as e:
            raise CompileError(f"{path / 'graph.json'}: {e}") from None
        return ModelSource(str(model), path, model_dir_hash(path), graph)
    if not path.is_dir():
        raise CompileError(f"model {str(model)!r} resolved to {path}, which is not a directory; pass an HF model directory")
    from portlayer.runtime.cache import needs_hashing

    todo = needs_hashing(path)
    if todo and todo >= OVERLAP_MIN_BYTES:
        from portlayer.flatten.background import in_thread

        # a capture that fails raises at once, not after the hash (which goes on and memoises the digest for the
        # next compile; a process that exits meanwhile still waits for the hashing pool's queued chunks)
        return PendingSource(str(model), path, in_thread(lambda: model_dir_hash(path), "portlayer-model-hash"))
    return ModelSource(str(model), path, model_dir_hash(path))
