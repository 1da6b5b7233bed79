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
from concurrent.futures import Future
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
CAPTURE_FORMAT = "portlayer.captured"
CAPTURE_MANIFEST = "captured.json"
#: captures whose weights exceed this many bytes (default 2 GiB) are not cached (issue 20: disk and time)
CAPTURE_CACHE_MAX_ENV = "PORTLAYER_CAPTURE_CACHE_MAX_BYTES"


def _capture_entry(model_sha: str, verify: bool) -> tuple[str, Path]:
    """The capture cache's key and entry for a model digest and this toolkit (content-addressed)."""
    from portlayer.runtime.cache import _sha, cache_root, toolkit_fingerprint

    key = _sha([model_sha, toolkit_fingerprint()] + ([] if verify else ["no-verify"]))
    return key, cache_root() / "captured" / key[:24]


def capture_cached(path: Path, model_sha: str, say: Callable[[str], None], verify: bool = True) -> Graph:
    """Capture an HF directory, reusing an earlier capture of identical files and toolkit.

    The entry is content-addressed (its name is a hash of the model files' hashes and the
    toolkit) and verified like an artifact: captured.json records the sha256 of each file,
    the graph is parsed from the bytes that were checked, and a mismatch (or any unlisted
    file) is reported as a warning and the model is captured again.
    """
    from portlayer.flatten import capture

    key, entry = _capture_entry(model_sha, verify)
    if entry.exists():
        try:
            graph = _load_capture(entry, key)
            say("reusing an earlier capture")
            return graph
        except Exception as e:  # any damage, whatever it trips over: warn and capture again
            import warnings

            warnings.warn(f"capture cache entry {entry} is damaged or was modified ({e}); capturing again",
                          UserWarning, stacklevel=2)
            _discard(entry)
    graph = capture(path, progress=say, verify=verify)
    remember_capture(graph, model_sha, verify, say)
    return graph


def remember_capture(graph: Graph, model_sha: str, verify: bool, say: Callable[[str], None]) -> None:
    """Keep a capture in the capture cache, unless its weights are big (see CAPTURE_CACHE_MAX_ENV)."""
    key, entry = _capture_entry(model_sha, verify)
    nbytes = sum(t.nbytes() for t in graph.params.values())
    if nbytes <= int(os.environ.get(CAPTURE_CACHE_MAX_ENV, 2 << 30)):
        if not entry.exists():
            _store_capture(graph, entry, key)
    else:  # a second copy of a big model on disk costs more (write + hash) than capturing it again
        say(f"capture not cached: {nbytes / (1 << 30):.1f} GiB of weights > ${CAPTURE_CACHE_MAX_ENV}")


def capture_while_hashing(pending: Any, verify: bool, stages: Stages) -> Any:
    """Capture a PendingSource's directory while its digest is computed (portlayer/model_source.py);
    returns the resolved ModelSource holding the graph (kept in the capture cache by build_artifact, on a
    miss only). ``timings["source_wait"]``: what the digest took beyond the capture. A capture that fails
    while the digest already failed on a user error (a file changed while it was read) reports the digest's."""
    from portlayer.errors import PortlayerError
    from portlayer.flatten import capture

    with stages.stage("capture") as say:
        say("the model digest is computed beside it")
        try:
            graph = capture(pending.path, progress=say, verify=verify)
        except Exception as e:
            try:  # a digest that is about to fail on the same file: a second is enough to hear it
                why = pending.digest.exception(timeout=1.0)
            except TimeoutError:
                why = None
            if isinstance(why, PortlayerError):
                raise why from e
            raise
        t0 = time.perf_counter()
        src = pending.resolve(graph)
        stages.timings["source_wait"] = round(time.perf_counter() - t0, 3)
        src.captured_beside_digest = True
    return src


def _load_capture(entry: Path, key: str) -> Graph:
    import hashlib
    import json

    from portlayer.flatten.serialize import load_graph

    doc = json.loads((entry / CAPTURE_MANIFEST).read_bytes())
    if not isinstance(doc, dict) or doc.get("format") != CAPTURE_FORMAT or doc.get("key") != key:
        raise ValueError(f"{CAPTURE_MANIFEST} is not a capture manifest for this key")
    files = doc.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ValueError(f"{CAPTURE_MANIFEST}: 'files' must map names to sha256")
    present = {p.name for p in entry.iterdir()} - {CAPTURE_MANIFEST}
    if present != set(files):
        raise ValueError(f"files {sorted(present ^ set(files))} are not what {CAPTURE_MANIFEST} lists")
    held: dict[str, bytes] = {}

    def read(name: str) -> bytes:
        if name not in files:
            raise ValueError(f"{name} is not listed in {CAPTURE_MANIFEST}")
        if name not in held:
            data = (entry / name).read_bytes()
            if hashlib.sha256(data).hexdigest() != files[name]:
                raise ValueError(f"{name}: sha256 differs from {CAPTURE_MANIFEST}")
            held[name] = data
        return held[name]

    def open_weights(name: str) -> Any:
        """Hashed in chunks, then memory-mapped: the weights are never read into memory whole."""
        from portlayer.flatten.weights_stream import open_safetensors
        from portlayer.runtime.artifact import sha256_file

        p = entry / name
        if name not in files:
            raise ValueError(f"{name} is not listed in {CAPTURE_MANIFEST}")
        before = p.stat()
        if sha256_file(p) != files[name]:
            raise ValueError(f"{name}: sha256 differs from {CAPTURE_MANIFEST}")
        after = p.stat()
        if (before.st_ino, before.st_size, before.st_mtime_ns) != (after.st_ino, after.st_size, after.st_mtime_ns):
            raise ValueError(f"{name}: changed while it was being checked")
        return open_safetensors(p)

    return load_graph(entry, read=read, open_weights=open_weights)


def _store_capture(graph: Graph, entry: Path, key: str) -> None:
    """Write the entry atomically (staging dir, hashes, rename); a failure leaves no entry."""
    import json

    from portlayer.flatten.serialize import save_graph
    from portlayer.runtime.artifact import sha256_file

    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
    try:
        save_graph(graph, tmp)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())}  # in chunks: never the whole file in memory
        (tmp / CAPTURE_MANIFEST).write_text(json.dumps({"format": CAPTURE_FORMAT, "key": key, "files": files}))
        os.replace(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def _discard(entry: Path) -> None:
    trash = entry.with_name(f".{entry.name}.bad-{os.getpid()}")
    try:
        os.rename(entry, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


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


def optimize_with_gate(graph: Graph, descriptor: Descriptor, overrides: dict[str, Any], strict: bool,
                       say: Callable[[str], None], calibration_device: str | None = None,
                       ) -> tuple[Any, str, dict[str, Any] | None]:
    """optimize() behind the quality gate (passes/gated.py): a lossy format the policy picked by default
    is kept only if it passes; an explicit one below threshold warns loudly, or is refused with strict.
    ``calibration_device``: where the quantize pass calibrates and the gate runs (default cpu)."""
    import sys

    from portlayer.passes.gated import run_gated
    from portlayer.runtime.validation import build_cases

    prompts = [c.steps[0].input_ids for c in build_cases(graph) if not c.paged]
    outcome = run_gated(graph, descriptor, overrides, prompts=prompts, say=say, device=calibration_device)
    for line in outcome.lines():
        print(f"[portlayer] {line}", file=sys.stderr)
    if outcome.warning:
        if strict:
            from portlayer.api import CompileError

            raise CompileError(f"refused (--strict): {outcome.warning.split('; pass --strict')[0]}")
        print(f"[portlayer] WARNING: {outcome.warning}", file=sys.stderr)
    doc = outcome.to_json() if (outcome.gate is not None or outcome.rejected) else None
    return outcome.result, "passes.gated.run_gated (passes.pipeline.run_pipeline + quality gate)", doc


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


def build_binaries(desc: Any, out_dir: Path, options: dict[str, Any], say: Any) -> list[Path]:
    """The kernels compiled to the target's binaries (codegen/aot.py), unless --sources-only."""
    if options.get("sources_only"):
        return []
    from portlayer.codegen.aot import build_binaries as build

    say("kernel binaries")
    return build(out_dir, desc) or []


def binaries_summary(out_dir: Path) -> dict[str, Any]:
    """The manifest's "binaries" entry: kind, target, toolchain and one {file, sha256} per kernel."""
    import json

    index = json.loads((out_dir / "binaries.json").read_text())
    return {"kind": index["kind"], "target": index["target"], "toolchain": index["toolchain"],
            "compile_s": index["seconds"], "jobs": index["jobs"],
            "kernels": {n: {"file": k["file"], "sha256": k["sha256"],
                            **({"variants": [{"file": v["file"], "sha256": v["sha256"]} for v in k["variants"]]}
                               if k.get("variants") else {})}
                        for n, k in index["kernels"].items()}}


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
def _captured(src: Any, options: dict[str, Any], stages: Stages) -> Graph:
    """The capture stage (unless it ran beside the digest), then the logit-row selection of causal LMs."""
    import torch

    from portlayer.flatten import capture
    from portlayer.flatten.logits import select_logit_rows

    if src.captured_beside_digest:  # its capture stage ran already (capture_while_hashing); a miss: keep it
        remember_capture(src.obj, src.sha256, options.get("verify", True), lambda _msg: None)
        return select_logit_rows(src.obj)
    with stages.stage("capture") as say:
        if isinstance(src.obj, Graph):
            graph = src.obj
        elif isinstance(src.obj, torch.nn.Module):
            graph = capture(src.obj, progress=say, verify=options.get("verify", True))
        else:
            graph = capture_cached(src.path, src.sha256, say, verify=options.get("verify", True))
        return select_logit_rows(graph)  # causal LMs: lm_head only on the sampled rows


def build_artifact(src: Any, desc: Descriptor, options: dict[str, Any], key: str, final: Path, stages: Stages) -> Path:
    """Run every stage for ``src`` (an api.ModelSource) and write the artifact to ``final`` atomically."""
    from safetensors.torch import save_file

    from portlayer.flatten.serialize import WeightsWrite, save_graph
    from portlayer.runtime import artifact as A
    from portlayer.runtime import validation as V

    graph = _captured(src, options, stages)
    overrides = {k: v for k, v in (("compute_dtype", options["dtype"]), ("weight_quantization", options["quantize"]),
                                   ("tensor_parallel", options.get("tensor_parallel")),
                                   ("kv_cache_dtype", options.get("kv_cache_dtype"))) if v}
    with stages.stage("passes") as say:
        say(f"for {desc.name}")
        result, passes_how, gate_doc = optimize_with_gate(graph, desc, overrides, bool(options.get("strict")), say,
                                                          options.get("calibration_device"))
    block_size = int(getattr(result.plan, "kv_block_size", None) or 16)
    from portlayer.runtime.parallel.shards import rank_graphs, world_size, write_shards

    if world_size(result.plan) > 1:  # ranks 1..N-1: same program, their own weight shards
        with stages.stage("shards") as say:
            say(f"{world_size(result.plan)} tensor-parallel ranks")
            rank_weights = rank_graphs(graph, result)
    # A lossy plan: the reference is the quantized graph's own semantics, so `validate` checks the
    # generated code tightly; how far quantization moved the answers is the quality gate's figure.
    try:
        mode = result.plan.value("weight_quantization")
    except KeyError:
        mode = None
    lossy = mode not in (None, "none")
    seed = 0
    reference = _start_reference(result.graph if lossy else graph, block_size, seed, stages)
    with A.ArtifactWriter(final) as w:
        weights = None
        try:
            weights = WeightsWrite(result.graph, w.dir)  # the weights go to the disk while codegen runs
            with stages.stage("codegen") as say:
                say(f"backend for {desc.device_type}")
                files, backend, codegen_how = codegen(result, w.dir)
                binaries = build_binaries(result.descriptor, w.dir, options, say) if files else []
            weights.raise_if_failed()  # a full disk says so now, not after the validation set
            with stages.stage("write") as say:
                say(str(final))
                save_graph(result.graph, w.dir, weights=False)  # graph.json; weights.safetensors: WeightsWrite
                if world_size(result.plan) > 1:
                    write_shards(w, rank_weights)
                w.write_json(A.PLAN, result.plan.to_json(), "plan")
                w.write_json(A.CAPABILITY, desc.raw, "capability")
                cases = reference.result()  # computed beside codegen and the weights' write
                doc, tensors = V.to_files(cases, graph, block_size, seed)
                doc["reference"] = "quantized graph" if lossy else "captured graph"
                w.write_json(A.VALIDATION, doc, "validation")
                save_file(tensors, str(w.dir / A.VALIDATION_TENSORS))
                copy_tokenizer(src.path, w.dir / A.TOKENIZER_DIR)
                for f in files:
                    w.declare(f if f.is_absolute() else w.dir / f, "source")
                for f in binaries:
                    w.declare(f, "source")  # generated by the backend, like the kernel sources
                t0 = time.perf_counter()
                weights.join()
                stages.timings["weights"] = round(weights.seconds, 3)  # began with codegen
                stages.timings["weights_wait"] = round(time.perf_counter() - t0, 3)
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
                if binaries:
                    manifest["binaries"] = binaries_summary(w.dir)
                manifest["capture"] = capture_summary(graph, options)
                if gate_doc is not None:
                    manifest["quality_gate"] = gate_doc
                return w.commit(manifest)
        except BaseException:
            if weights is not None:  # stops within its in-flight window: a failed compile does not wait for the rest
                weights.cancel()
            raise


#: "1" computes the validation set before codegen, in the calling thread (the serial order)
SERIAL_REFERENCE_ENV = "PORTLAYER_SERIAL_REFERENCE"


class _Reference:
    """The validation set on the reference interpreter, computed in a helper thread while codegen and
    the artifact's write run (torch's ops release the GIL); ``result()`` waits for it. The cases and
    their float32 outputs are the same as the serial computation's: same graph, same ops, same seed."""

    def __init__(self, graph: Graph, block_size: int, seed: int, stages: Stages) -> None:
        import torch

        from portlayer.flatten.background import in_thread
        from portlayer.runtime import validation as V

        grad = torch.is_grad_enabled()  # thread-local in torch: the helper runs as its caller would
        self._stages = stages

        def run() -> Any:
            t0 = time.perf_counter()
            try:
                with torch.set_grad_enabled(grad):
                    return V.compute_reference(graph, block_size, seed)
            finally:
                stages.timings["reference"] = round(time.perf_counter() - t0, 3)

        self._serial = os.environ.get(SERIAL_REFERENCE_ENV) == "1"
        if self._serial:  # computed now; an error is raised by result(), as from the thread
            self._pending: Future[Any] = Future()
            with stages.stage("reference") as say:
                say("validation set on the reference interpreter")
                try:
                    self._pending.set_result(run())
                except BaseException as e:  # noqa: BLE001 - re-raised by result()
                    self._pending.set_exception(e)
        else:
            self._pending = in_thread(run, "portlayer-reference")

    def result(self) -> Any:
        if self._serial:
            return self._pending.result()
        t0 = time.perf_counter()
        try:
            return self._pending.result()  # re-raises what the reference raised
        finally:
            self._stages.timings["reference_wait"] = round(time.perf_counter() - t0, 3)


def _start_reference(graph: Graph, block_size: int, seed: int, stages: Stages) -> _Reference:
    return _Reference(graph, block_size, seed, stages)


def capture_summary(graph: Graph, options: dict[str, Any]) -> dict[str, Any]:
    """How the capture read the model (issue 20): weights memory-mapped or copied, layers exported
    once and repeated, and what the self-check compared (the full model's own forward)."""
    out: dict[str, Any] = {k: graph.meta[k] for k in ("weights_binding", "layers_repeated") if k in graph.meta}
    out["self_check"] = ("full model: the graph against HF's forward, every layer" if options.get("verify", True)
                         else "skipped (--no-verify)")
    return out


def _history(result: Any) -> list[dict[str, Any]]:
    out = []
    for item in getattr(result, "history", []) or []:
        name, summary = (item[0], item[1]) if isinstance(item, (tuple, list)) and len(item) == 2 else (str(item), {})
        out.append({"pass": str(name), "summary": summary if isinstance(summary, dict) else str(summary)})
    return out
