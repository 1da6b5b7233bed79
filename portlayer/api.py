"""The public API: ``compile`` a model into a verified artifact, ``load`` one to run or validate.

    art = portlayer.compile("tiny-qwen3")          # target="auto": the best device here
    m = portlayer.load(art.path)                  # hashes and device checked first
    print(m.validate().format_table())
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from portlayer.errors import PortlayerError

if TYPE_CHECKING:
    import torch

    from portlayer.capabilities.descriptor import Descriptor
    from portlayer.flatten.ir import Graph
    from portlayer.loaded import LoadedArtifact
    from portlayer.runtime.artifact import Manifest

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}
QUANTIZE = ("none", "int8", "int4", "native")


class CompileError(PortlayerError):
    """A compile option or model the user passed cannot be used as given."""


@dataclass
class Artifact:
    """A compiled artifact on disk; ``cache_hit`` says whether this call reused an earlier compile."""

    path: Path
    cache_hit: bool
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def manifest(self) -> Manifest:
        from portlayer.runtime.artifact import read_manifest

        return read_manifest(self.path)

    def load(self, check_device: bool = True) -> LoadedArtifact:
        return load(self.path, check_device=check_device)

    def __str__(self) -> str:
        m = self.manifest
        how = "cache hit" if self.cache_hit else "compiled"
        return f"{how}: {m.model.get('spec')} for {m.target.get('name')} -> {self.path} ({self.seconds:.1f} s)"


@dataclass
class ModelSource:
    spec: str
    path: Path | None
    sha256: str
    obj: Any = None  # an nn.Module or a Graph passed in memory


def _model_source(model: Any) -> ModelSource:
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
    if isinstance(model, (str, os.PathLike)):
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
        return ModelSource(str(model), path, _hash_while_importing(path))
    raise CompileError(f"compile() takes a model name, an HF directory, an nn.Module or a Graph, not {type(model).__name__}")


#: unmemoised model bytes from which hashing them is worth overlapping with the capture's imports
PREWARM_MIN_BYTES = 256 << 20


def _hash_while_importing(path: Path) -> str:
    """model_dir_hash(path); when it has big files to read (a first compile: nothing memoised, so no
    cached artifact can match either), the capture's imports (transformers, the model's modeling
    module: seconds) run in a helper thread meanwhile, and are joined before anything else runs."""
    import threading

    from portlayer.runtime.cache import model_dir_hash, needs_hashing

    if needs_hashing(path) < PREWARM_MIN_BYTES:
        return model_dir_hash(path)
    t = threading.Thread(target=_prewarm_imports, args=(path,), name="portlayer-prewarm", daemon=True)
    t.start()
    try:
        return model_dir_hash(path)
    finally:
        t.join()


def _prewarm_imports(path: Path) -> None:
    import importlib
    import json

    names = ["portlayer.flatten.capture", "transformers", "portlayer.flatten.from_export", "portlayer.flatten.patterns",
             "portlayer.passes.pipeline"]
    try:
        mt = json.loads((path / "config.json").read_text()).get("model_type")
        if isinstance(mt, str) and mt.isidentifier():
            names.append(f"transformers.models.{mt}.modeling_{mt}")
    except (OSError, ValueError, AttributeError):
        pass
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optimisation only: the capture imports (and reports) it again
            pass


def _options(dtype: str | torch.dtype | None, quantize: str | None, strict: bool = False) -> dict[str, Any]:
    d = None
    if dtype is not None:
        key = str(dtype).removeprefix("torch.")
        if key not in DTYPES:
            raise CompileError(f"--dtype {dtype!r} is not supported; use one of float32, bfloat16, float16")
        d = DTYPES[key]
    if quantize is not None and quantize not in QUANTIZE:
        raise CompileError(f"--quantize {quantize!r} is not supported; use one of {', '.join(QUANTIZE)}")
    return {"dtype": d, "quantize": quantize, **({"strict": True} if strict else {})}


def _tp_option(value: int | str) -> int | str:
    if str(value) == "auto":
        return "auto"
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise CompileError(f"--tensor-parallel {value!r}: use a positive number of ranks, or auto")
    return n


def compile(  # noqa: A001 - the public name users expect
    model: str | os.PathLike[str] | torch.nn.Module | Graph,
    target: str | os.PathLike[str] | Descriptor = "auto",
    output: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype | None = None,
    quantize: str | None = None,
    progress: bool = True,
    strict: bool = False,
    verify: bool = True,
    tensor_parallel: int | str | None = None,
    sources_only: bool | None = None,
) -> Artifact:
    """Compile ``model`` for ``target`` into an artifact directory (``output``, else the cache).

    ``model``: a local HF directory, a saved Flat IR directory (graph.json), a built-in name (tiny-qwen3, all-minilm-l6-v2), an
    nn.Module or a captured Graph. ``target``: "auto", a shipped descriptor name or a
    descriptor .json path. A compile whose key is already cached returns at once. ``sources_only``: GPU
    targets ship kernel sources but no compiled binaries (default: $PORTLAYER_SOURCES_ONLY=1, else binaries).
    ``tensor_parallel``: N ranks or "auto" (docs/parallel.md).
    """
    from portlayer.build import Stages, resolve_target
    from portlayer.runtime import cache

    t0 = time.perf_counter()
    if output is not None:  # refuse a path we may not replace before any work (and before anything is written)
        from portlayer.runtime.artifact import check_output_dir

        check_output_dir(Path(output).absolute())
    stages = Stages(progress)
    options = _options(dtype, quantize, strict)  # strict: refuse a lossy format below the quality gate
    if not verify:  # skip the capture self-check (flatten/selfcheck.py); keyed apart in the cache
        options["verify"] = False
    if sources_only or (sources_only is None and os.environ.get("PORTLAYER_SOURCES_ONLY") == "1"):
        options["sources_only"] = True  # GPU targets: no kernel binaries (JIT on the device); keyed apart
    if tensor_parallel not in (None, 1, "1"):  # docs/parallel.md; absent at 1, so other cache keys do not move
        options["tensor_parallel"] = _tp_option(tensor_parallel)
    desc = resolve_target(target)
    t_src = time.perf_counter()
    src = _model_source(model)  # the model's digest (its weights' bytes hashed unless memoised) for the cache key
    stages.timings["source"] = round(time.perf_counter() - t_src, 3)
    from portlayer.capabilities.tuning import tuning_digest  # tuned launch configs change the artifact

    key = cache.cache_key(src.sha256, desc.sha256 + tuning_digest(desc), options)

    def build(final: Path) -> Path:
        from portlayer.build import build_artifact

        return build_artifact(src, desc, options, key, final, stages)

    if output is None:
        path, hit = cache.get_or_build(key, build)
    else:
        out = Path(output).resolve()
        cached = cache.lookup(key)
        hit = cached is not None
        path = _copy_artifact(cached, out) if cached else build(out)
    return Artifact(Path(path), hit, time.perf_counter() - t0, stages.timings)


def _copy_artifact(src: Path, dest: Path) -> Path:
    """Copy a verified cached artifact to ``dest`` atomically (staging copy, then rename)."""
    from portlayer.runtime.artifact import _replace_dir

    staged = dest.parent / f".{dest.name}.copy-{os.getpid()}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, staged, symlinks=True)
    _replace_dir(staged, dest)
    return dest


def load(path: str | os.PathLike[str], check_device: bool = True) -> LoadedArtifact:
    """Verify an artifact (every file's sha256, then the device) and open it.

    The big weights' hashes finish in background threads while the weights are loaded; the returned
    artifact's ``executable()`` / ``graph`` join them first (runtime/loaded.py; $PORTLAYER_VERIFY_WAIT=1
    checks everything before this returns).

    ``check_device=False`` opens an artifact built for another device to inspect its
    graph and plan; its executable then refuses to run.
    """
    from portlayer.loaded import open_artifact

    return open_artifact(Path(path), check_device=check_device)
