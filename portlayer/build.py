"""The compile stages, each pluggable so compile works today and picks up new stages as they land.

capture → optimise (passes/pipeline.run_pipeline when present, else the policy's plan on
the captured graph) → validation set (reference interpreter) → codegen (the backend
adapter's compile_program when it has one) → artifact directory. What actually ran is
recorded in the manifest's "stages", so an artifact says how it was made.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from portlayer.capabilities.descriptor import Descriptor
from portlayer.capabilities.plan import Plan
from portlayer.flatten.ir import Graph

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json",
)  # fmt: skip


@dataclass
class OptimizeResult:
    """The PipelineResult shape (graph, plan, descriptor, history) when passes/ is not installed."""

    graph: Graph
    plan: Plan
    descriptor: Descriptor
    history: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


# ---- progress -------------------------------------------------------------------------------
class Stages:
    """One tqdm bar per stage on stderr (or nothing with ``enabled=False``); records timings."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.timings: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[Callable[[str], None]]:
        t0 = time.perf_counter()
        bar = None
        if self.enabled:
            from tqdm import tqdm

            bar = tqdm(total=1, desc=f"{name:<10}", bar_format="{desc}: {bar:20} {elapsed}{postfix}", leave=True)
        try:
            yield (lambda msg: bar.set_postfix_str(msg[:70]) if bar is not None else None)
            if bar is not None:
                bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            self.timings[name] = round(time.perf_counter() - t0, 3)


# ---- target and model ---------------------------------------------------------------------
def resolve_target(target: str | os.PathLike[str] | Descriptor) -> Descriptor:
    from portlayer.capabilities.descriptor import load_descriptor

    if isinstance(target, Descriptor):
        return target
    if str(target) == "auto":
        from portlayer.capabilities.probe import default_target

        return default_target()
    return load_descriptor(target)


def target_label(desc: Descriptor) -> str:
    """What to pass to --target to get this descriptor again: its name if shipped, else its path."""
    from portlayer.capabilities.descriptor import DEVICES_DIR

    return desc.name if Path(desc.origin).parent == DEVICES_DIR else desc.origin


# ---- stages ---------------------------------------------------------------------------------
def capture_cached(path: Path, model_sha: str, say: Callable[[str], None], verify: bool = True) -> Graph:
    """Capture an HF directory, reusing an earlier capture of identical files and toolkit."""
    from portlayer.flatten import capture
    from portlayer.flatten.serialize import load_graph, save_graph
    from portlayer.runtime.cache import _sha, cache_root, toolkit_fingerprint

    entry = cache_root() / "captured" / _sha([model_sha, toolkit_fingerprint()] + ([] if verify else ["no-verify"]))[:24]
    if (entry / "graph.json").is_file():
        try:
            say("reusing an earlier capture")
            return load_graph(entry)
        except Exception:  # damaged entry: capture again
            shutil.rmtree(entry, ignore_errors=True)
    graph = capture(path, progress=say, verify=verify)
    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
    try:
        save_graph(graph, tmp)
        os.replace(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return graph


def optimize(graph: Graph, descriptor: Descriptor, overrides: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(result with graph/plan/descriptor/history, what ran): run_pipeline if passes/ has it."""
    try:
        pipeline = importlib.import_module("portlayer.passes.pipeline")
    except ModuleNotFoundError as e:
        if e.name not in ("portlayer.passes.pipeline", "portlayer.passes"):
            raise
        pipeline = None
    if pipeline is not None and hasattr(pipeline, "run_pipeline"):
        result = pipeline.run_pipeline(graph, descriptor, overrides=overrides or None)
        return result, "passes.pipeline.run_pipeline"
    from portlayer.capabilities.policy import plan_for_graph

    plan = plan_for_graph(graph, descriptor, overrides or None)
    return OptimizeResult(graph, plan, descriptor), "capabilities.policy.plan_for_graph (passes/pipeline.py absent: graph not optimised)"


def codegen(result: Any, out_dir: Path) -> tuple[list[Path], str, str]:
    """(generated files, backend name, what ran) through the adapter's compile_program if it has one."""
    from portlayer.backends.registry import get_backend

    try:
        adapter = get_backend(result.descriptor)
    except KeyError as e:  # no adapter for this device type installed: the artifact still carries IR + plan
        return [], result.descriptor.device_type, f"none ({e.args[0]})"
    fn = getattr(adapter, "compile_program", None)
    if fn is None:
        return [], adapter.name, f"none ({type(adapter).__name__} has no compile_program: runs the reference executable)"
    files = [Path(p) for p in fn(result, out_dir) or []]
    return files, adapter.name, f"{type(adapter).__name__}.compile_program"


def copy_tokenizer(model_dir: Path | None, dest: Path) -> list[Path]:
    if model_dir is None or not model_dir.is_dir():
        return []
    out = []
    for name in TOKENIZER_FILES:
        src = model_dir / name
        if src.is_file():
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest / name)
            out.append(dest / name)
    return out


# ---- the whole build ----------------------------------------------------------------------
def build_artifact(src: Any, desc: Descriptor, options: dict[str, Any], key: str, final: Path, stages: Stages) -> Path:
    """Run every stage for ``src`` (an api.ModelSource) and write the artifact to ``final`` atomically."""
    import torch
    from safetensors.torch import save_file

    from portlayer.flatten import capture
    from portlayer.flatten.ir import Graph
    from portlayer.flatten.serialize import save_graph
    from portlayer.runtime import artifact as A
    from portlayer.runtime import validation as V

    with stages.stage("capture") as say:
        if isinstance(src.obj, Graph):
            graph = src.obj
        elif isinstance(src.obj, torch.nn.Module):
            graph = capture(src.obj, progress=say, verify=options.get("verify", True))
        else:
            graph = capture_cached(src.path, src.sha256, say, verify=options.get("verify", True))
        from portlayer.flatten.logits import select_logit_rows

        graph = select_logit_rows(graph)  # causal LMs: lm_head only on the sampled rows
    overrides = {k: v for k, v in (("compute_dtype", options["dtype"]), ("weight_quantization", options["quantize"])) if v}
    with stages.stage("passes") as say:
        say(f"for {desc.name}")
        result, passes_how = optimize(graph, desc, overrides)
    block_size = int(getattr(result.plan, "kv_block_size", None) or 16)
    with stages.stage("reference") as say:
        say("validation set on the reference interpreter")
        seed = 0
        cases = V.compute_reference(graph, block_size, seed)
    with A.ArtifactWriter(final) as w:
        with stages.stage("codegen") as say:
            say(f"backend for {desc.device_type}")
            files, backend, codegen_how = codegen(result, w.dir)
        with stages.stage("write") as say:
            say(str(final))
            save_graph(result.graph, w.dir)
            w.write_json(A.PLAN, result.plan.to_json(), "plan")
            w.write_json(A.CAPABILITY, desc.raw, "capability")
            doc, tensors = V.to_files(cases, graph, block_size, seed)
            w.write_json(A.VALIDATION, doc, "validation")
            save_file(tensors, str(w.dir / A.VALIDATION_TENSORS))
            copy_tokenizer(src.path, w.dir / A.TOKENIZER_DIR)
            for f in files:
                w.declare(f if f.is_absolute() else w.dir / f, "source")
            rel_files = sorted(str((f if f.is_absolute() else w.dir / f).relative_to(w.dir)) for f in files)
            manifest = {
                "model": {"spec": src.spec, "source": str(src.path) if src.path else None, "sha256": src.sha256,
                          "task": graph.meta.get("task"), "model_type": graph.meta.get("model_type")},
                "target": {"name": desc.name, "label": target_label(desc), "device_type": desc.device_type,
                           "arch": desc.arch, "codegen": desc.codegen, "backend": backend, "sha256": desc.sha256},
                "options": options,
                "cache_key": key,
                "stages": {"passes": passes_how, "codegen": codegen_how, "history": _history(result)},
                "codegen": {"generated": bool(files), "files": rel_files},
                "timings_s": dict(stages.timings),
            }
            return w.commit(manifest)


def _history(result: Any) -> list[dict[str, Any]]:
    out = []
    for item in getattr(result, "history", []) or []:
        name, summary = (item[0], item[1]) if isinstance(item, (tuple, list)) and len(item) == 2 else (str(item), {})
        out.append({"pass": str(name), "summary": summary if isinstance(summary, dict) else str(summary)})
    return out
