"""A verified artifact opened for use: its graph, plan, descriptor, executable and validation.

Nothing here runs before `verify_artifact` has checked every file's hash, and the
executable is built only for a device the device check accepted. The big weights' chunk hashes
are checked in background threads while the weights are mapped and copied to the device; the
check is joined before the graph or an executable reaches the caller (LoadedArtifact.executable).
"""

from __future__ import annotations

import functools
import html
import os
import sys
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

from portlayer.capabilities.descriptor import Descriptor, DescriptorError
from portlayer.capabilities.plan import Plan
from portlayer.flatten.ir import Graph
from portlayer.runtime import artifact as A
from portlayer.runtime.artifact import ArtifactError, Manifest

#: set to 1: the load checks every file's hash before anything else, as before the overlap (slower)
VERIFY_WAIT_ENV = "PORTLAYER_VERIFY_WAIT"
#: files that make a tokenizer (generation_config.json alone does not)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model", "merges.txt")


def _recompile(m: Manifest) -> str:
    return m.recompile_command(m.target.get("label") or m.target.get("name", "auto"))


class LoadedArtifact:
    """Use ``portlayer.load(path)`` to get one."""

    def __init__(self, manifest: Manifest, plan: Plan, descriptor: Descriptor, device: Any, notes: list[str],
                 emulated: bool = False, interpreted: bool = False) -> None:
        self.manifest = manifest
        self.emulated = emulated  # a CANN artifact run on the CPU emulator of torch_npu (not an NPU)
        self.interpreted = interpreted  # a Triton artifact run on this CPU by the Triton interpreter (not a GPU)
        self.path = manifest.path
        self.plan = plan
        self.descriptor = descriptor
        self.device = device  # the local DetectedDevice that runs it (None when the check was skipped)
        self.notes = notes  # toolkit version differences
        self.tp_rank: int | None = None  # set on each rank of a tensor-parallel group (runtime/parallel/)
        self.verify_started: float | None = None  # perf_counter when open_artifact began verifying
        self._verified = manifest.pending is None
        if manifest.pending is not None:  # dropped unused: stop hashing for it
            weakref.finalize(self, manifest.pending.cancel)

    def __repr__(self) -> str:
        return f"<LoadedArtifact {self.manifest.model.get('spec')} for {self.descriptor.name} at {self.path}>"

    @property
    def graph(self) -> Graph:
        """The artifact's graph with its weights, once the weights' hash check has passed."""
        self.join_verification()
        return self._mapped_graph

    def join_verification(self) -> None:
        """Wait for the weights' background hash check (verify_artifact(wait=False)); a mismatch or a file
        replaced during the load raises the ArtifactError the blocking check would have. Says on stderr
        what was verified and how long it took when that was over 2 s."""
        if self._verified:
            return
        A.join_verification(self.manifest)  # raises on every call once it failed
        self._verified = True
        pending = self.manifest.pending
        t0 = self.verify_started if self.verify_started is not None else pending.check.started
        done = pending.check.finished or time.perf_counter()
        if done - t0 > 2.0:
            _say_verified(self.manifest, done - t0, f" ({pending.check.bytes / (1 << 30):.2f} GiB of weights hashed "
                          f"while they were loaded; the load waited {pending.waited_s:.1f} s for it)")

    @functools.cached_property
    def _mapped_graph(self) -> Graph:
        """The graph, its weights memory-mapped: not for use before join_verification (see ``graph``)."""
        from portlayer.flatten.serialize import GraphFileError, load_graph
        from portlayer.flatten.verify import VerificationError, verify_graph

        try:  # from the bytes verified by load() (weights: re-checked against the manifest as read)
            graph = load_graph(self.path, read=lambda name: A.read_verified_bytes(self.manifest, name),
                               open_weights=lambda name: A.open_verified_weights(self.manifest, name))
            verify_graph(graph)  # the IR rules, kernel groups and memory plan: codegen trusted them
        except GraphFileError as e:
            raise ArtifactError(f"{e}\nRecompile: `{_recompile(self.manifest)}`") from None
        except VerificationError as e:
            raise ArtifactError(f"{self.path / A.GRAPH}: {e}\nRecompile: `{_recompile(self.manifest)}`") from None
        return graph

    @property
    def torch_device(self) -> str:
        return (self.device.torch_device if self.device is not None else None) or "cpu"

    def executable(self) -> Any:
        """The program to run: the backend's generated host program if it has one, else the reference.

        The join point of the weights' background hash check: the program is built (weights mapped and
        copied to the device) while the hashes are checked, and returned only once they match; nothing
        runs a program step before (the engine's warm-up and every run come after this returns). On a
        mismatch what was built is dropped and the ArtifactError says which file differs.
        A load over 2 s says on stderr what it moved and how fast (weights are memory-mapped and
        copied to the device through pinned staging buffers, codegen/weight_upload.py)."""
        t0 = time.perf_counter()
        try:
            exe = self._executable()
        except Exception:
            self.join_verification()  # a damaged weights file is reported as such, not as what reading it did
            raise
        try:
            self.join_verification()
        except ArtifactError:
            _drop(exe)
            del exe
            self.__dict__.pop("_mapped_graph", None)
            _free_device_cache()
            raise
        dt = time.perf_counter() - t0
        if dt > 2.0:
            nbytes = sum(int(f.get("bytes", 0)) for f in self.manifest.files.values() if f.get("kind") == "weights")
            print(f"[portlayer] loaded {self.path.name}: {nbytes / (1 << 30):.2f} GiB of weights onto "
                  f"{self.torch_device} in {dt:.1f} s ({nbytes / dt / 1e9:.2f} GB/s)", file=sys.stderr)
        return exe

    def _executable(self) -> Any:
        if self.device is None:
            raise ArtifactError(
                f"artifact {self.path} was opened with check_device=False; load it with the device check to run it"
            )
        from portlayer.backends.registry import get_backend
        from portlayer.runtime.executable import ReferenceExecutable

        if self.tp_rank is None and (_plan_value(self.plan, "tensor_parallel", 1) or 1) > 1:
            from portlayer.runtime.parallel.launch import start_executable

            return start_executable(self)  # rank 0's proxy over the group (docs/parallel.md)
        graph = self._mapped_graph  # joined by executable() before the program is returned
        if self.interpreted:  # the generated program, its kernels run by TRITON_INTERPRET=1 on the CPU
            from portlayer.backends.triton_program import load_program

            return load_program(self.path, graph.weights, "cpu", self.plan, use_graphs=False)
        if self.manifest.raw.get("codegen", {}).get("generated"):
            adapter = get_backend(self.descriptor, index=max(self.device.index, 0))
            loader = getattr(adapter, "load_program", None)
            sources = A.verified_sources(self.manifest)  # the bytes load() checked: never re-read from disk
            if loader is not None and self.emulated:  # CANN program bound to the CPU emulator of torch_npu
                from portlayer.backends.ascend_emulator import AscendEmulator

                return loader(self.path, graph.weights, plan=self.plan, npu=AscendEmulator(), sources=sources)
            if loader is not None:  # the Plan sizes its buffers and picks its CUDA-graph batch sizes
                return loader(self.path, graph.weights, plan=self.plan, sources=sources)
        return ReferenceExecutable(graph, device=self.torch_device)

    # ---- validation ----------------------------------------------------------------------
    def validation_cases(self) -> tuple[dict[str, Any], list[Any]]:
        from safetensors import SafetensorError
        from safetensors.torch import load

        from portlayer.runtime.validation import from_files

        doc = A.read_json_file(self.manifest, A.VALIDATION)
        tpath = self.path / A.VALIDATION_TENSORS
        try:
            tensors = load(A.read_verified_bytes(self.manifest, A.VALIDATION_TENSORS))
        except (SafetensorError, OSError, ValueError) as e:
            raise ArtifactError(f"{tpath}: not a readable safetensors file ({e}); recompile: `{_recompile(self.manifest)}`") from None
        try:
            return doc, from_files(doc, tensors)
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(
                f"{self.path / A.VALIDATION}: malformed validation set ({type(e).__name__}: {e}); recompile: "
                f"`{_recompile(self.manifest)}`"
            ) from None

    def validate(self, executable: Any = None) -> Any:
        """Re-run the validation set here; a ValidationReport with max error per output vs tolerance."""
        from portlayer.runtime.validation import validate

        doc, cases = self.validation_cases()
        exe = executable or self.executable()
        mode = _plan_value(self.plan, "weight_quantization", "none") or "none"
        return validate(exe, self.graph, cases, int(doc.get("kv_block_size") or 16), doc.get("output_names", []),
                        quantization=mode, exact_reference=doc.get("reference") == "quantized graph")

    def tokenizer(self) -> Any:
        """The model's tokenizer from the artifact (None when the model had no tokenizer files).

        Built from the verified bytes, copied to a private temporary directory (the artifact's own
        files may have changed since load()). Only generation_config.json is not a tokenizer."""
        rels = [r for r in self.manifest.files_of("tokenizer") if not r.endswith("/generation_config.json")]
        if not any(Path(r).name in TOKENIZER_FILES for r in rels):
            return None
        import tempfile

        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory(prefix="portlayer-tok-") as tmp:
            for rel in rels:
                dest = Path(tmp) / Path(rel).relative_to(A.TOKENIZER_DIR)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(A.read_verified_bytes(self.manifest, rel))
            try:
                return AutoTokenizer.from_pretrained(tmp)
            except (OSError, ValueError, TypeError, KeyError) as e:
                raise ArtifactError(f"{self.path / A.TOKENIZER_DIR}: the tokenizer files do not load ({type(e).__name__}: "
                                    f"{str(e)[:300]}); pass token ids, or recompile: `{_recompile(self.manifest)}`") from None

    # ---- running ------------------------------------------------------------------------
    def engine(self, **kwargs: Any) -> Any:
        """A runtime LLMEngine (scheduler, paged KV cache, sampler) over this artifact's executable."""
        from portlayer.backends.registry import get_backend
        from portlayer.runtime.engine import LLMEngine

        exe = self.executable()
        meta = dict(self.graph.meta)
        if self.interpreted:  # KV caches in host memory, laid out as the artifact's descriptor says
            from portlayer.backends.registry import backend_class

            kwargs.setdefault("backend", backend_class("cpu")(self.descriptor, 0))
        if self.descriptor.device_type == exe.device.type:  # the artifact's descriptor: its allocation and tuning
            idx = self.device.index if self.device is not None and self.device.index is not None else 0
            kwargs.setdefault("backend", get_backend(self.descriptor, index=max(idx, 0)))
        kwargs.setdefault("backend", get_backend(exe.device.type))
        kwargs.setdefault("tokenizer", self.tokenizer())
        return LLMEngine(exe, meta, self.plan, **kwargs)

    def generate(self, prompt: str | list[int], max_tokens: int = 16, **kwargs: Any) -> Any:
        """Greedy generation of one prompt through the engine; a RequestOutput."""
        from portlayer.runtime.sequence import SamplingParams

        eng = self.engine(**kwargs)
        return eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0]

    def embed(self, texts: list[str], **kwargs: Any) -> Any:
        """Sentence embeddings [n, hidden] through the engine (the model's own pooling)."""
        return self.engine(**kwargs).embed(texts)

    def _repr_html_(self) -> str:
        from portlayer.capabilities.plan_view import plan_html

        m = self.manifest
        rows = [("model", m.model.get("spec")), ("target", f"{self.descriptor.name} ({self.descriptor.arch}, "
                f"{self.descriptor.codegen})"), ("path", str(self.path)), ("files", str(len(m.files))),
                ("stages", "; ".join(f"{k}: {v}" for k, v in m.raw.get("stages", {}).items() if k != "history"))]
        body = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>"
                       f"{html.escape(str(v))}</td></tr>" for k, v in rows)
        return f"<div class='portlayer-artifact'><table>{body}</table>{plan_html(self.plan)}</div>"


def _drop(exe: Any) -> None:
    """Release an executable built on weights that failed their check (a tensor-parallel group is closed)."""
    close = getattr(exe, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: S110 - best effort: the ArtifactError being raised is what matters
            pass


def _free_device_cache() -> None:
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _plan_value(plan: Plan, name: str, default: Any) -> Any:
    try:
        return plan.value(name)
    except KeyError:
        return default


def interpreted_device(m: Manifest) -> Any:
    """The stand-in device for running a Triton artifact (CUDA, ROCm, XPU) on this CPU under the Triton
    interpreter: the generated host program and kernels, CUDA graphs off. Explicitly requested only."""
    import os

    from portlayer.capabilities.probe import DetectedDevice

    if m.target.get("codegen") != "triton":
        raise ArtifactError(f"artifact {m.path} targets {m.target.get('name')} (codegen {m.target.get('codegen')}); "
                            "only Triton artifacts run under the Triton interpreter. Drop --interpret.")
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ArtifactError("running a Triton artifact on the CPU needs TRITON_INTERPRET=1 set before triton is imported; "
                            "use `portlayer validate|run ARTIFACT --interpret`, or set it first in your process")
    return DetectedDevice(str(m.target.get("device_type")), 0, "Triton interpreter on the CPU (TRITON_INTERPRET=1; "
                          "not a GPU)", str(m.target.get("arch")), "cpu", m.target.get("name"), "interpreted",
                          "explicitly requested: --interpret / interpret=True")


def open_artifact(path: Any, check_device: bool = True, emulate: bool | None = False,
                  interpret: bool = False) -> LoadedArtifact:
    """``emulate=True`` opens a CANN (Ascend) artifact to run on portlayer's CPU emulator of the
    torch_npu calls (docs/ascend.md) instead of checking for an NPU; any other artifact is refused.
    ``emulate=None`` means "if PORTLAYER_ASCEND_EMULATOR=1 and the artifact is CANN".
    ``interpret=True`` opens a Triton artifact to run on this CPU under the Triton interpreter.

    The big weights' hashes are checked in background threads and joined by the returned artifact's
    ``executable()`` / ``graph`` (the copy to the device overlaps the check); with ``check_device=False``
    (nothing can run, only inspect) or $PORTLAYER_VERIFY_WAIT=1 every file is checked before this returns."""
    t0 = time.perf_counter()
    blocking = os.environ.get(VERIFY_WAIT_ENV) == "1" or not (check_device or interpret or emulate is not False)
    m = A.verify_artifact(path, wait=blocking)
    try:
        loaded = _open_verified(m, check_device, emulate, interpret)
    except BaseException:
        if m.pending is not None:
            m.pending.cancel()
        raise
    loaded.verify_started = t0
    if m.pending is None and time.perf_counter() - t0 > 2.0:
        _say_verified(m, time.perf_counter() - t0)
    return loaded


def _say_verified(m: Manifest, seconds: float, how: str = "") -> None:
    """The one stderr line of a verification over 2 s, blocking (open_artifact) or overlapped (the join)."""
    nbytes = sum(int(f.get("bytes", 0)) for f in m.files.values())
    print(f"[portlayer] verified {m.path.name}: sha256 of {nbytes / (1 << 30):.2f} GiB in {seconds:.1f} s{how}",
          file=sys.stderr)


def _open_verified(m: Manifest, check_device: bool, emulate: bool | None, interpret: bool) -> LoadedArtifact:
    if emulate is None:
        from portlayer.backends.ascend import emulator_requested

        emulate = emulator_requested() and m.target.get("codegen") == "cann"
    raw_plan = A.read_json_file(m, A.PLAN)
    try:
        plan = Plan.from_json(raw_plan)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ArtifactError(
            f"{m.path / A.PLAN}: not a plan ({type(e).__name__}: {e}); the artifact is damaged, recompile: "
            f"`{_recompile(m)}`"
        ) from None
    try:
        desc = Descriptor.from_dict(A.read_json_file(m, A.CAPABILITY), origin=str(m.path / A.CAPABILITY))
    except DescriptorError as e:
        raise ArtifactError(f"{e}\nThe artifact's descriptor is damaged; recompile: `{_recompile(m)}`") from None
    if interpret:
        device = interpreted_device(m)
        dtype = plan.value("compute_dtype") if "compute_dtype" in plan.names() else None
        if dtype == "bfloat16":  # numpy has no bfloat16: the interpreter's bf16 arithmetic is not the GPU's
            raise ArtifactError(f"artifact {m.path} computes in bfloat16, which the Triton interpreter does not "
                                "reproduce on the CPU (its results would differ from the reference for that reason "
                                "alone); to check a GPU artifact here, compile it with --dtype float32")
    elif emulate:  # explicit request: a CANN artifact on the CPU emulator (A.emulated_device refuses others)
        device = A.emulated_device(m)
    else:
        device = A.check_device(m) if check_device else None
    notes = A.version_notes(m)
    for n in notes:
        warnings.warn(f"artifact {m.path}: {n}", UserWarning, stacklevel=4)
    return LoadedArtifact(m, plan, desc, device, notes, emulated=bool(emulate) and not interpret, interpreted=interpret)


def print_notes(loaded: LoadedArtifact) -> None:
    for n in loaded.notes:
        print(f"[portlayer] note: {n}", file=sys.stderr)


__all__ = ["LoadedArtifact", "open_artifact", "print_notes"]
