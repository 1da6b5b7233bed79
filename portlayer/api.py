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

from portlayer.model_source import CompileError, ModelSource, PendingSource, model_source  # noqa: F401 - CompileError, ModelSource: public here

if TYPE_CHECKING:
    import torch

    from portlayer.capabilities.descriptor import Descriptor
    from portlayer.flatten.ir import Graph
    from portlayer.loaded import LoadedArtifact
    from portlayer.runtime.artifact import Manifest

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}
QUANTIZE = ("none", "int8", "int4", "native")


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


def _kv_cache_dtype(value: str | torch.dtype) -> str:
    from portlayer.capabilities.policy import KV_CACHE_DTYPES

    key = str(value).removeprefix("torch.")
    key = {"fp8": "float8_e4m3fn", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(key, key)
    if key not in KV_CACHE_DTYPES:
        raise CompileError(f"--kv-cache-dtype {value!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}")
    return key


def _calibration_device(value: str) -> str:
    """A torch device string this process can use for the quantize pass's calibration and the quality gate."""
    import torch

    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError):
        raise CompileError(f"--calibration-device {value!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CompileError(f"--calibration-device {value!r}: this machine has no CUDA device; leave it at cpu")
    if dev.type not in ("cpu", "cuda"):
        raise CompileError(f"--calibration-device {value!r}: only cpu and cuda run the calibration")
    return str(dev)


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
    calibration_device: str | None = None,
    kv_cache_dtype: str | None = None,
) -> Artifact:
    """Compile ``model`` for ``target`` into an artifact directory (``output``, else the cache).

    ``model``: a local HF directory, a saved Flat IR directory (graph.json), a built-in name (tiny-qwen3, all-minilm-l6-v2), an
    nn.Module or a captured Graph. ``target``: "auto", a shipped descriptor name or a
    descriptor .json path. A compile whose key is already cached returns at once. ``sources_only``: GPU
    targets ship kernel sources but no compiled binaries (default: $PORTLAYER_SOURCES_ONLY=1, else binaries).
    ``tensor_parallel``: N ranks or "auto" (docs/parallel.md). ``calibration_device``: where an int8/int4 compile
    runs its calibration and quality gate (default cpu; "cuda" on a GPU host, where a big model's calibration on
    the CPU takes minutes; docs/quantization.md). ``kv_cache_dtype``: the KV cache's element type: float8_e4m3fn
    where the descriptor's kernels read it (twice the tokens a GiB, lossy; docs/performance.md), else the compute dtype,
    which the Plan keeps by default.
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
    if kv_cache_dtype is not None:  # absent unless asked, so other cache keys do not move
        options["kv_cache_dtype"] = _kv_cache_dtype(kv_cache_dtype)
    if calibration_device not in (None, "cpu"):  # absent for the CPU default, so other cache keys do not move
        options["calibration_device"] = _calibration_device(calibration_device)
    desc = resolve_target(target)
    t_src = time.perf_counter()
    src = model_source(model)  # the model's digest (its weights' bytes hashed unless memoised) for the cache key
    stages.timings["source"] = round(time.perf_counter() - t_src, 3)
    if isinstance(src, PendingSource):  # big files not memoised: the digest runs beside the capture
        from portlayer.build import capture_while_hashing

        src = capture_while_hashing(src, options.get("verify", True), stages)
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
