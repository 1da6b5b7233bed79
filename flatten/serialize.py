"""Save and load a Flat IR graph: structure as graph.json, weights as weights.safetensors.

JSON keeps the graph diffable and language-neutral; safetensors keeps weights loadable
without executing code (never pickle). safetensors refuses tensors that share storage
(tied embeddings, views of one fused weight), so identical tensors are written once
and the others recorded as aliases, and partial views are written as copies.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from portlayer.errors import PortlayerError
from portlayer.flatten.dims import DimError, parse_tree
from portlayer.flatten.ir import Graph, Node, TensorType, Value, dtype_name

FORMAT = "portlayer.flat_ir"
FORMAT_VERSION = 1
GRAPH_FILE = "graph.json"
WEIGHTS_FILE = "weights.safetensors"


class GraphFileError(PortlayerError, ValueError):
    """A saved graph directory is missing a file, or a file is not what save_graph writes."""


def graph_to_json(graph: Graph) -> dict[str, Any]:
    """The graph structure as a JSON-able dict (weights are not included; see save_graph)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "inputs": [v.to_json() for v in graph.inputs],
        "params": [{"name": k, **t.to_json()} for k, t in graph.params.items()],
        "nodes": [n.to_json() for n in graph.nodes],
        "outputs": list(graph.outputs),
        "meta": graph.meta,
    }


def graph_from_json(d: dict[str, Any], *, source: str = "graph JSON") -> Graph:
    """Inverse of graph_to_json; ``source`` names where ``d`` came from in errors."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        found = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise GraphFileError(f"{source}: expected a dict with format={FORMAT!r}, found {found!r}")
    version = d.get("format_version")
    if version != FORMAT_VERSION:
        raise GraphFileError(
            f"{source}: format_version {version!r} is not supported (this portlayer reads {FORMAT_VERSION}); "
            "re-save the graph with this version of portlayer"
        )
    problem = structure_problem(d)
    if problem:
        raise GraphFileError(f"{source}: {problem}; the file is damaged or not a saved graph")
    try:
        graph = Graph(
            inputs=[Value.from_json(v) for v in d["inputs"]],
            params={p["name"]: TensorType(p["dtype"], tuple(p["shape"])) for p in d["params"]},
            nodes=[Node.from_json(n) for n in d["nodes"]],
            outputs=list(d["outputs"]),
            meta=dict(d.get("meta", {})),
        )
        _check_plan_dims(graph.meta.get("memory_plan"))
        return graph
    except KeyError as e:
        raise GraphFileError(f"{source}: missing key {e.args[0]!r}; the file is incomplete or not a saved graph") from None
    except (TypeError, ValueError, AttributeError, RecursionError) as e:
        raise GraphFileError(f"{source}: malformed entry ({type(e).__name__}: {str(e)[:300]})") from None


#: the largest static dimension a saved graph may declare (no real tensor comes near it)
MAX_STATIC_DIM = 1 << 48


def structure_problem(d: dict[str, Any]) -> str | None:
    """The first way ``d`` departs from the JSON layout graph_to_json writes, or None.

    Checked before anything is built, so a damaged file gives one clear message instead of
    whatever a constructor trips over (symbolic dims are parsed later, by flatten.ir)."""

    def value_problem(v: Any, where: str) -> str | None:
        if not isinstance(v, dict) or not isinstance(v.get("name"), str) or not isinstance(v.get("dtype"), str):
            return f"{where} must be an object with string 'name' and 'dtype'"
        shape = v.get("shape")
        if not isinstance(shape, list):
            return f"{where} ({v['name']}): 'shape' must be a list"
        for dim in shape:
            if isinstance(dim, bool) or not isinstance(dim, (int, str)):
                return f"{where} ({v['name']}): dimension {dim!r} is neither an integer nor a symbolic expression"
            if isinstance(dim, int) and not 0 <= dim <= MAX_STATIC_DIM:
                return f"{where} ({v['name']}): dimension {dim} is out of range [0, 2**48]"
        return None

    for key in ("inputs", "params", "nodes", "outputs"):
        if key not in d:
            return f"missing key {key!r}"
        if not isinstance(d[key], list):
            return f"'{key}' must be a list"
    if not isinstance(d.get("meta", {}), dict):
        return "'meta' must be an object"
    for key in ("inputs", "params"):
        for i, v in enumerate(d[key]):
            if p := value_problem(v, f"{key}[{i}]"):
                return p
    for i, n in enumerate(d["nodes"]):
        where = f"nodes[{i}]"
        if not isinstance(n, dict) or not isinstance(n.get("name"), str) or not isinstance(n.get("op"), str):
            return f"{where} must be an object with string 'name' and 'op'"
        where = f"node {n['name']}"
        ins, outs = n.get("inputs"), n.get("outputs")
        if not isinstance(ins, list) or not all(x is None or isinstance(x, str) for x in ins):
            return f"{where}: 'inputs' must be a list of value names (or null for an absent optional input)"
        if not isinstance(outs, list):
            return f"{where}: 'outputs' must be a list of values"
        for j, v in enumerate(outs):
            if p := value_problem(v, f"{where}: outputs[{j}]"):
                return p
        for key in ("attrs", "meta"):
            if not isinstance(n.get(key, {}), dict):
                return f"{where}: '{key}' must be an object"
    if not all(isinstance(o, str) for o in d["outputs"]):
        return "'outputs' must be a list of value names"
    return None


def _check_plan_dims(plan: Any) -> None:
    """The memory plan's sizes and offsets are dims too: read them by the strict grammar now."""
    if plan is None:
        return
    bufs = plan.get("buffers") if isinstance(plan, dict) else None
    if not isinstance(bufs, dict):
        raise ValueError("meta.memory_plan has no 'buffers' object")
    for name, buf in bufs.items():
        for key in ("size", "offset"):
            v = buf.get(key) if isinstance(buf, dict) else None
            if isinstance(v, bool) or not isinstance(v, (int, str)):
                raise ValueError(f"meta.memory_plan buffer {name!r}: {key} {v!r} is not an int or a dim string")
            if isinstance(v, str):
                try:
                    parse_tree(v)
                except DimError as e:
                    raise ValueError(f"meta.memory_plan buffer {name!r} {key}: {e}") from None


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device.type, t.untyped_storage().data_ptr())


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (*_storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def dedupe_weights(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors safetensors accepts, plus {alias: stored name} for tensors identical to a stored one.

    Identical views (the same storage, offset, shape, strides, dtype) become aliases;
    other tensors that overlap a storage already used are written as copies.
    """
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_view: dict[tuple[Any, ...], str] = {}
    storages: dict[tuple[Any, ...], int] = {}
    for name, t in weights.items():
        if t.numel() == 0:
            stored[name] = t.detach().cpu().contiguous()
            continue
        vk = _view_key(t)
        if vk in by_view:
            aliases[name] = by_view[vk]
            continue
        by_view[vk] = name
        sk = _storage_key(t)
        storages[sk] = storages.get(sk, 0) + 1
    for name, t in weights.items():
        if name in aliases or name in stored:
            continue
        t = t.detach()
        shares = storages[_storage_key(t)] > 1 or t.numel() != t.untyped_storage().nbytes() // t.element_size()
        stored[name] = t.cpu().clone().contiguous() if (shares or not t.is_contiguous()) else t.cpu()
    return stored, aliases


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_graph(graph: Graph, directory: str | os.PathLike, weights: bool = True) -> Path:
    """Write graph.json and weights.safetensors into ``directory`` (created if missing).

    ``weights=False``: graph.json only (the weights file is written by ``WeightsWrite``, beside other work)."""
    stray = sorted(set(graph.weights) - set(graph.params))
    if stray:
        raise ValueError(f"graph.weights has tensors that are not params: {stray}; add them to graph.params or drop them")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    from portlayer.flatten.weights_stream import stream_entries

    entries, aliases = stream_entries(graph.weights)  # tensor by tensor: never a second copy of the model
    doc = graph_to_json(graph)
    doc["weights"] = {"file": WEIGHTS_FILE, "names": list(graph.weights), "aliases": aliases}
    text = json.dumps(doc, indent=1)
    _atomic_write(out / GRAPH_FILE, lambda p: Path(p).write_text(text + "\n"))
    if weights:
        _write_weights(entries, out)
    return out


def _write_weights(entries: Any, out: Path, on_tensor: Callable[[str], None] | None = None) -> None:
    from portlayer.flatten.weights_stream import write_tensors

    _atomic_write(out / WEIGHTS_FILE, lambda p: write_tensors(p, entries, metadata={"format": "pt", "portlayer": FORMAT},
                                                              on_tensor=on_tensor))


class WeightsWrite:
    """weights.safetensors of ``graph`` written into ``directory`` by a helper thread, so a compile's codegen
    runs while its weights (the bulk of the artifact) go to the disk. ``join`` waits and re-raises what the
    write raised; ``cancel`` stops it within its in-flight window (the tensors already handed to the writer
    threads finish; a failed compile does not wait for the rest)."""

    def __init__(self, graph: Graph, directory: str | os.PathLike) -> None:
        import threading
        import time

        from portlayer.flatten.background import in_thread
        from portlayer.flatten.weights_stream import stream_entries

        entries, _ = stream_entries(graph.weights)
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        self.seconds = 0.0

        def stop_check(_name: str) -> None:
            if self._stop.is_set():
                raise _Cancelled

        def run() -> None:
            t0 = time.perf_counter()
            try:
                _write_weights(entries, out, stop_check)
            finally:
                self.seconds = time.perf_counter() - t0

        self._done = in_thread(run, "portlayer-weights-write")

    def raise_if_failed(self) -> None:
        """Re-raise the write's error now if it already failed (without waiting for a running write)."""
        if self._done.done():
            self._done.result()

    def join(self) -> None:
        self._done.result()

    def cancel(self) -> None:
        self._stop.set()
        self._done.exception()  # waits; the error (a _Cancelled, say) is the caller's own failure's consequence


class _Cancelled(Exception):
    """Raised inside the writer thread to stop a cancelled write."""


def load_graph(directory: str | os.PathLike, *, read: Callable[[str], bytes] | None = None,
               open_weights: Callable[[str], Any] | None = None) -> Graph:
    """Read a directory written by save_graph; errors name the file and what was expected.

    ``read(file_name) -> bytes`` supplies the files instead of the disk (a loaded artifact
    passes the bytes it verified, so a file changed after verification is never used).
    ``open_weights(file_name) -> {name: tensor}`` opens the weights file instead of ``read``
    (a loaded artifact memory-maps it: no copy of the model is read into memory up front)."""
    from safetensors.torch import load, load_file

    root = Path(directory)
    gpath = root / GRAPH_FILE
    if read is None and not gpath.is_file():
        raise GraphFileError(f"{gpath}: not found; expected a {GRAPH_FILE} written by portlayer's save_graph")
    try:
        doc = json.loads(read(GRAPH_FILE) if read is not None else gpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GraphFileError(f"{gpath}: not valid JSON ({e}); the file is corrupt, re-save the graph") from None
    except RecursionError:
        raise GraphFileError(f"{gpath}: JSON nested too deeply to be a saved graph; the file is corrupt") from None
    graph = graph_from_json(doc, source=str(gpath))
    winfo = doc.get("weights", {})
    if not isinstance(winfo, dict):
        raise GraphFileError(f"{gpath}: 'weights' must be an object {{file, names, aliases}}, found {type(winfo).__name__}")
    names, aliases = winfo.get("names", []), winfo.get("aliases", {})
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or not isinstance(aliases, dict) \
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise GraphFileError(f"{gpath}: 'weights' must list 'names' (strings) and 'aliases' (name -> stored name)")
    wfile = winfo.get("file", WEIGHTS_FILE)
    if not isinstance(wfile, str) or Path(wfile).name != wfile:
        raise GraphFileError(f"{gpath}: weights file {wfile!r} must be a plain file name beside {GRAPH_FILE}")
    wpath = root / wfile
    if read is None and not wpath.is_file():
        if names:
            raise GraphFileError(f"{wpath}: not found; {gpath.name} lists {len(names)} weights stored there")
        return graph
    try:
        if open_weights is not None:
            tensors = open_weights(wfile)
        else:
            tensors = load(read(wfile)) if read is not None else load_file(str(wpath))
    except Exception as e:  # safetensors raises its own error types for corrupt headers/data
        if isinstance(e, PortlayerError):  # e.g. the artifact's reader refusing a changed file
            raise
        raise GraphFileError(f"{wpath}: not a readable safetensors file ({e}); the file is corrupt, re-save the graph") from None
    for name in names:
        src = aliases.get(name, name)
        if src not in tensors:
            raise GraphFileError(f"{wpath}: tensor {src!r} (for param {name!r}) is missing")
        t = tensors[src]
        want = graph.params.get(name)
        if want is None:
            raise GraphFileError(f"{gpath}: weight {name!r} has no entry in params")
        if dtype_name(t.dtype) != want.dtype or tuple(t.shape) != tuple(want.shape):
            raise GraphFileError(
                f"{wpath}: tensor {src!r} is {dtype_name(t.dtype)}{list(t.shape)} but param {name!r} "
                f"is declared {want}; the two files do not belong together"
            )
        graph.weights[name] = t
    return graph
