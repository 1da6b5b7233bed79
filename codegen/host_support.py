"""What generated host programs import: step state, buffer views, kernel loading, CUDA graphs.

A generated program (host.py in the artifact) is a subclass of :class:`HostProgram` that
only says which kernels run in which order on which buffers; the mechanics shared by every
program live here, once, under test.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from portlayer.codegen.step_graphs import StepGraphFailed, StepGraphs
from portlayer.codegen.step_graphs import enabled as step_graphs_enabled
from portlayer.flatten.ir import torch_dtype
from portlayer.flatten.op_defs.attention import AttentionMetadata


def W_T(w: torch.Tensor) -> torch.Tensor:  # noqa: N802 - reads like math in generated code
    """nn.Linear weights are [out, in]; torch.mm wants [in, out]: a transposed view, no copy."""
    return w.t()


def concatenate_weights(w: SimpleNamespace, merged: Mapping[str, Sequence[str]]) -> None:
    """program.json's ``merged_weights``: each name becomes its parts concatenated along dim 0 (one vendor GEMM
    reads them, codegen/kernels/gemm_merged.py), and each part a row-slice view of it, so the weights are held
    once. Each entry's parts are checked before it changes anything."""
    if not isinstance(merged, Mapping) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(p, str) for p in v) for k, v in merged.items()):
        raise ValueError("program.json: merged_weights is not a {name: [part names]} table; recompile the artifact")
    for name, parts in merged.items():
        tensors = [getattr(w, p, None) for p in parts]
        missing = [p for p, t in zip(parts, tensors) if t is None]
        if missing or not parts:
            raise KeyError(f"host program: merged weight {name} names parts {missing or parts} the weights lack")
        if any(t.shape[1:] != tensors[0].shape[1:] or t.dtype != tensors[0].dtype for t in tensors):
            raise ValueError(f"host program: merged weight {name}: parts {list(parts)} differ in dtype or trailing shape")
        cat = torch.cat(tensors, dim=0)
        setattr(w, name, cat)
        start = 0
        for p, t in zip(parts, tensors):
            setattr(w, p, cat[start:start + t.shape[0]])
            start += t.shape[0]


def gemm_block_m(tokens: int, largest: int) -> int:
    """Row tile of the Triton GEMM: the smallest power of two >= tokens, in [16, largest]."""
    bm = 16
    while bm < tokens and bm < largest:
        bm *= 2
    return bm


def gemm_block_m_choices(largest: int) -> list[dict[str, int]]:
    """Every BLOCK_M that gemm_block_m can pick (one kernel binary each)."""
    return [{"BLOCK_M": bm} for bm in sorted({gemm_block_m(t, largest) for t in range(1, 2 * largest + 1)})]


def gemv_block_choices(max_rows: int, block_k: int, least: int = 32, min_rows: int = 1,
                       tensor_cores: bool = False) -> list[dict[str, int]]:
    """Every (BLOCK_M, BLOCK_K) that gemv_blocks can pick for min_rows..max_rows rows: one per power of two
    up to the first >= max_rows (gemv_blocks pads rows to a power of two), so a huge max_rows costs log2 steps.
    ``tensor_cores``: the tier's choices (rows from gemv_max_tokens + 1 to gemv_dot_max_tokens)."""
    pairs, bm = set(), 1
    while bm < max(1, min_rows):
        bm *= 2
    while True:
        pairs.add(gemv_blocks(bm, block_k, least, tensor_cores))
        if bm >= max(1, max_rows):
            break
        bm *= 2
    return [{"BLOCK_M": bm, "BLOCK_K": bk} for bm, bk in sorted(pairs)]


#: The tensor-core tier's A tile ([BLOCK_M, BLOCK_K]) holds at most this many elements: the K tile narrows as
#: rows grow so A, the [BLOCK_N, BLOCK_K] W tile and the accumulator stay in registers (no [M, N, K] product).
DOT_A_TILE = 8192


def gemv_blocks(rows: int, block_k: int, least: int = 32, tensor_cores: bool = False) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) of the few-rows GEMM for a step: rows padded to a power of two, and the K
    tile narrowed as rows grow so the [rows, BLOCK_N, BLOCK_K] products keep one register budget
    (never below ``least``: a quantized tile holds whole groups). ``tensor_cores`` (the tl.dot tier):
    at least 16 rows (tl.dot's smallest tile) and an A tile of at most DOT_A_TILE elements."""
    bm = 16 if tensor_cores else 1
    while bm < rows:
        bm *= 2
    if tensor_cores:
        return bm, max(least, min(block_k, DOT_A_TILE // bm))
    return bm, max(least, block_k // bm)


def kv_cache_dtype(executable: Any) -> torch.dtype:
    """The element type an executable's attention reads its paged KV cache in: a generated program's
    (program.json kv_cache_dtype, the Plan's decision), else its compute dtype (the reference executable)."""
    return getattr(executable, "kv_dtype", None) or executable.dtype


def decode_splits(sequences: int, kv_heads: int, programs: int, most: int) -> int:
    """KV splits per sequence for a decode-attention step: the smallest power of two whose programs
    (sequences x KV heads x splits) reach ``programs`` (launch.attention_decode's PROGRAMS per compute unit), at most
    ``most`` (the scratch's width). A function of the batch alone, so a captured graph's splits fit every replay;
    with one split the kernel writes its output and no reduce runs (a full batch pays no partial results)."""
    splits, have = 1, max(1, sequences) * max(1, kv_heads)
    while splits < most and have * splits < programs:
        splits *= 2
    return splits


def ref(op: str, inputs: Sequence[Any], attrs: Mapping[str, Any], st: StepState) -> list[torch.Tensor]:
    """Run one op's reference implementation (ops with no kernel template, and the CPU program)."""
    from portlayer.flatten.interpret import ExecContext
    from portlayer.flatten.ops import get_op

    ctx = ExecContext(bindings={"num_tokens": st.num_tokens, "num_seqs": st.num_seqs}, attn_metadata=st.meta,
                      kv_cache=st.kv_caches, device=st.device)
    return get_op(op).reference(list(inputs), attrs, ctx)


def load_kernels(directory: Path, names: Sequence[str], sources: Any = None, device: Any = None) -> SimpleNamespace:
    """Execute each kernels/<name>.py from ``sources`` (codegen/source_loader.VerifiedSources: the
    bytes checked at load time; read from ``directory`` once when not given), never importing
    the file. Triton reads each kernel's source through linecache, where the loader put it."""
    from portlayer.codegen.kernel_binaries import bind
    from portlayer.codegen.source_loader import module_name, read_directory

    directory = Path(directory).resolve()
    src = sources if sources is not None else read_directory(directory, ("*.py",))
    fns: dict[str, Any] = {}
    for name in names:
        path = directory / f"{name}.py"
        mod = src.exec_module(path, module_name(src, path, "portlayer_kernels"))
        for attr in dir(mod):
            if attr.startswith(name):
                fns[attr] = getattr(mod, attr)
    return SimpleNamespace(**bind(fns, src, device))  # the artifact's cubin/hsaco where the device runs them


@dataclass
class StepState:
    """One step's sequence layout on the device, in the dtypes the kernels read."""

    num_tokens: int
    num_seqs: int
    num_prefills: int
    num_decodes: int
    max_query_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor | None
    block_tables: torch.Tensor | None
    bt_stride: int
    block_size: int
    paged: bool
    meta: AttentionMetadata | None
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None
    device: torch.device
    # Buffers kept across steps by the program for this thread (torch-family ops that would otherwise
    # allocate a large fresh tensor per layer and step: codegen/torch_attention.py's KV gathers).
    workspace: dict[str, torch.Tensor] | None = None
    # The sequence the decode kernels' first program serves: the first decode of an eager step (prefills come
    # first), 0 in a captured step (one program per sequence slot; those of prefills and empty slots return).
    decode_offset: int = 0

    @staticmethod
    def build(meta: AttentionMetadata | None, num_tokens: int, device: torch.device,
              kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None) -> StepState:
        meta = meta if meta is not None else AttentionMetadata.single(num_tokens, device=device)
        qsl = meta.query_start_loc.to(device=device, dtype=torch.int32, non_blocking=True)
        seq_lens = meta.seq_lens.to(device=device, dtype=torch.int32, non_blocking=True)
        slots = None if meta.slot_mapping is None else meta.slot_mapping.to(device=device, dtype=torch.int64)
        bt = None if meta.block_tables is None else meta.block_tables.to(device=device, dtype=torch.int32).contiguous()
        max_q = meta.max_query_len
        if not max_q:  # metadata built by hand: one host read of the query lengths
            q = meta.query_start_loc.cpu()
            max_q = int((q[1:] - q[:-1]).max()) if q.numel() > 1 else 0
        paged = kv_caches is not None and bt is not None
        n = int(meta.seq_lens.shape[0])
        prefills = meta.num_prefills if paged else n
        return StepState(num_tokens, n, prefills, n - prefills, max_q, qsl, seq_lens, slots if paged else None,
                         bt, bt.stride(0) if bt is not None else 0,
                         int(kv_caches[0][0].shape[1]) if paged else 16, paged, meta, kv_caches, device,
                         decode_offset=prefills)


class HostProgram(StepGraphs):
    """Base of generated programs. Subclasses set KERNELS, INPUTS, OUTPUTS and ``forward`` (and
    one method per folded layer); ``layout`` (program.json) says the weights and their dtypes, the
    arena's size and buffers (offsets from the memory plan) and the per-layer namespaces. This class
    allocates once and runs steps: CUDA graphs for decode steps whose batch fits a captured size, and
    (codegen/step_graphs.py) for steps with prefill tokens up to the largest ``step_sizes`` bucket."""

    KERNELS: tuple[str, ...] = ()
    SCRATCH: tuple[int, int] = (0, 0)  # decode split-K partials per sequence: (outputs, maxima)
    INPUTS: tuple[str, ...] = ()
    OUTPUTS: tuple[str, ...] = ()
    MAX_POSITIONS = 4096

    @property
    def input_names(self) -> tuple[str, ...]:
        """The Executable interface's declaration of the graph inputs this program reads."""
        return self.INPUTS

    def __init__(self, weights: Mapping[str, torch.Tensor], device: torch.device | str = "cpu", *,
                 layout: Mapping[str, Any], kernels_dir: Path | str | None = None, kernels: Any = None,
                 max_tokens: int | None = None, max_seqs: int = 256, capture_sizes: Sequence[int] = (),
                 step_sizes: Sequence[int] = (), use_graphs: bool = True, sources: Any = None) -> None:
        self.device = torch.device(device)
        self.layout = layout
        dtypes = dict(layout["params"])
        missing = [k for k in dtypes if k not in weights]
        if missing:
            raise KeyError(f"host program: weights missing {missing[:5]} (of {len(missing)}); pass the artifact's weights")
        from portlayer.codegen.weight_upload import upload

        self.W = SimpleNamespace(**upload(weights, {k: torch_dtype(dt) for k, dt in dtypes.items()}, self.device))
        concatenate_weights(self.W, layout.get("merged_weights") or {})
        floats = [torch_dtype(d) for d in dtypes.values() if d.startswith(("float", "bfloat"))]
        self.dtype = floats[0] if floats else torch.float32
        # the KV cache's element type the attention kernels were generated for (Plan kv_cache_dtype)
        self.kv_dtype = torch_dtype(layout["kv_cache_dtype"]) if layout.get("kv_cache_dtype") else self.dtype
        if kernels is not None:
            self.K = kernels
        else:
            self.K = (load_kernels(Path(kernels_dir), self.KERNELS, sources, self.device) if kernels_dir and self.KERNELS
                      else SimpleNamespace())
        planned = int(layout.get("max_tokens") or 0)
        if planned and max_tokens and max_tokens > planned:
            raise ValueError(f"max_tokens={max_tokens} exceeds the {planned} tokens the memory plan laid the arena out "
                             "for; recompile with a larger max_batched_tokens")
        self.max_tokens = planned or int(max_tokens or 2048)
        self.max_seqs = max(max_seqs, 1)
        self._buffers = {v: (info["dtype"], tuple(info["shape"]), int(info["offset"]))
                         for v, info in layout.get("buffers", {}).items()}
        # zeroed once: a padded step graph computes on rows no sequence owns (every op on them is per row, so
        # whatever they hold stays in them; zeros keep the arena's share of them finite)
        self.arena = torch.zeros(int(layout.get("arena_bytes") or 0) + 256, dtype=torch.uint8, device=self.device)
        self._workspaces = threading.local()  # per thread: embedding batches run side by side on one program
        self._layers = {m["method"]: m for m in layout.get("layers", [])}
        self.P = {name: {i: SimpleNamespace(**{loc: getattr(self.W, t.format(i + d)) for loc, (t, d) in m["params"].items()})
                         for i in range(m["first"], m["last"] + 1)} for name, m in self._layers.items()}
        out_n, max_n = self.SCRATCH
        self.part_out = torch.empty(max(1, self.max_seqs * out_n), dtype=torch.float32, device=self.device)
        self.part_max = torch.empty(max(1, self.max_seqs * max_n), dtype=torch.float32, device=self.device)
        self.part_sum = torch.empty(max(1, self.max_seqs * max_n), dtype=torch.float32, device=self.device)
        self._views: dict[tuple[int, int], SimpleNamespace] = {}
        self._layer_views: dict[tuple[str, int, int], dict[int, SimpleNamespace]] = {}
        self.capture_sizes = sorted(s for s in capture_sizes if s <= min(max_seqs, self.max_tokens))
        self.use_graphs = use_graphs and self.device.type == "cuda" and bool(self.capture_sizes)
        self._graphs: dict[tuple, tuple[Any, list[torch.Tensor]]] = {}
        self._static: SimpleNamespace | None = None
        # step graphs' token buckets (codegen/step_graphs.py; none with PORTLAYER_STEP_GRAPHS=0)
        self.step_sizes = sorted(t for t in step_sizes if 0 < t <= self.max_tokens) if step_graphs_enabled() else []
        self._step: SimpleNamespace | None = None

    # ---- buffers ---------------------------------------------------------------------
    def _view(self, value: str, T: int, S: int) -> torch.Tensor:  # noqa: N803
        dtype, shape, off = self._buffers[value]
        dims = [eval_host_dim(d, T, S) for d in shape]
        dt = torch_dtype(dtype)
        n = 1
        for d in dims:
            n *= d
        return self.arena[off : off + n * dt.itemsize].view(dt).view(dims)

    def buffers(self, T: int, S: int | None = None) -> SimpleNamespace:  # noqa: N803 - T tokens, S sequences
        """Views of the arena for a step of ``T`` tokens and ``S`` sequences (cached per size)."""
        S = T if S is None else S  # noqa: N806
        views = self._views.get((T, S))
        if views is None:
            if T > self.max_tokens:
                raise ValueError(f"step of {T} tokens exceeds the program's max_tokens={self.max_tokens} (the memory "
                                 "plan's largest bucket); recompile with a larger max_batched_tokens")
            views = SimpleNamespace(**{v: self._view(v, T, S) for v in self._buffers})
            if len(self._views) < 64:
                self._views[(T, S)] = views
        return views

    def layer_namespaces(self, method: str, layer: int, T: int, S: int) -> tuple[SimpleNamespace, SimpleNamespace]:  # noqa: N803
        """(weights, buffers) of one layer of a folded method, by the templates in program.json."""
        key = (method, T, S)
        per = self._layer_views.get(key)
        if per is None:
            m, full = self._layers[method], self.buffers(T, S)
            per = {i: SimpleNamespace(**{loc: getattr(full, t.format(i + d)) for loc, (t, d) in m["buffers"].items()})
                   for i in range(m["first"], m["last"] + 1)}
            if len(self._layer_views) < 256:
                self._layer_views[key] = per
        return self.P[method][layer], per[layer]

    def forward(self, T: int, S: int, feeds: Mapping[str, torch.Tensor], st: StepState,  # noqa: N803
                kv_caches: Any) -> list[torch.Tensor]:
        raise NotImplementedError

    # ---- one step --------------------------------------------------------------------
    def run(self, feeds: Mapping[str, torch.Tensor], attn_metadata: AttentionMetadata | None,
            kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None) -> list[torch.Tensor]:
        """The Executable interface: outputs for one step (the caller owns them)."""
        if kv_caches and kv_caches[0][0].dtype != self.kv_dtype:  # the kernels would read the bytes as their own type
            raise TypeError(f"host program: KV caches of {kv_caches[0][0].dtype}, but its attention kernels read "
                            f"{self.kv_dtype} caches (program.json kv_cache_dtype); allocate them with "
                            "portlayer.codegen.host_support.kv_cache_dtype(executable)")
        if self.INPUTS and feeds[self.INPUTS[0]].dim():
            T = int(feeds[self.INPUTS[0]].shape[0])  # noqa: N806
        else:  # a graph without a token-stream input: the step's size comes from its metadata
            T = int(attn_metadata.query_start_loc[-1]) if attn_metadata is not None else 1  # noqa: N806
        if self._graphable(T, attn_metadata, kv_caches):
            return self._replay(T, feeds, attn_metadata, kv_caches)
        if self._step_graphable(T, feeds, attn_metadata, kv_caches):
            try:
                return self._step_replay(T, feeds, attn_metadata, kv_caches)
            except StepGraphFailed:  # said once (a warning); this and later such steps run eagerly
                pass
        st = StepState.build(attn_metadata, T, self.device, kv_caches)
        st.workspace = self._workspaces.__dict__
        dev_feeds = {k: feeds[k].to(self.device, non_blocking=True) for k in self.INPUTS}
        outs = self.forward(T, st.num_seqs, dev_feeds, st, kv_caches)
        return [o.clone() for o in outs]

    # ---- CUDA graphs for decode ------------------------------------------------------
    def _graphable(self, T: int, meta: AttentionMetadata | None, kv_caches: Any) -> bool:  # noqa: N803
        return (self.use_graphs and kv_caches is not None and meta is not None and meta.block_tables is not None
                and meta.slot_mapping is not None and meta.num_prefills == 0 and int(meta.seq_lens.shape[0]) == T
                and T <= self.capture_sizes[-1]
                and meta.block_tables.shape[1] <= self._table_width(kv_caches))

    def _static_state(self, kv_caches: Any) -> SimpleNamespace:
        if self._static is None:
            n, dev = self.capture_sizes[-1], self.device
            width = self._table_width(kv_caches)
            with torch.inference_mode(False):  # made inside a step (inference mode), reset at load (outside it)
                self._static = SimpleNamespace(
                    feeds={k: torch.zeros(n, dtype=torch.int64, device=dev) for k in self.INPUTS},
                    slots=torch.full((n,), -1, dtype=torch.int64, device=dev),
                    seq_lens=torch.zeros(n, dtype=torch.int32, device=dev),
                    block_tables=torch.zeros(n, width, dtype=torch.int32, device=dev),
                    qsl=torch.arange(n + 1, dtype=torch.int32, device=dev),
                    rows={},  # T -> the static views a step of T sequences writes (built once per T)
                    padded_from=0,  # rows >= this hold no sequence (slot -1, length 0), whatever the last step wrote
                )
        return self._static

    def _table_width(self, kv_caches: Any) -> int:
        """Block-table columns of the static buffers: MAX_POSITIONS tokens in the caches' pages."""
        return -(-self.MAX_POSITIONS // int(kv_caches[0][0].shape[1]))

    @staticmethod
    def _cache_pointers(kv_caches: Any) -> tuple[int, ...]:
        """The KV cache addresses a captured graph baked in (a graph replays only on the same caches)."""
        return tuple(c.data_ptr() for pair in kv_caches for c in pair)

    @staticmethod
    def _pad_from(s: SimpleNamespace, T: int) -> None:  # noqa: N803
        """Make static rows ``T``.. read as empty sequences (slot -1, length 0): only the rows a larger step
        wrote since the last reset are rewritten (``padded_from``: rows past it are empty already)."""
        if s.padded_from > T:
            s.slots[T : s.padded_from].fill_(-1)
            s.seq_lens[T : s.padded_from].fill_(0)
        s.padded_from = T

    def _replay(self, T: int, feeds: Mapping[str, torch.Tensor], meta: AttentionMetadata,  # noqa: N803
                kv_caches: Any) -> list[torch.Tensor]:
        """Copy the step's inputs into the graph's static buffers and replay it. Every torch call here costs
        the host ~5-15 us while the device waits for the replay (a waited decode step): views are built once
        per size, and the rows past the batch are reset only when a larger step left them holding data."""
        s = self._static_state(kv_caches)
        views = s.rows.get(T)
        if views is None:
            B = next(b for b in self.capture_sizes if b >= T)  # noqa: N806
            views = s.rows[T] = (B, [s.feeds[k][:T] for k in self.INPUTS], s.slots[:T], s.seq_lens[:T], {})
        B, dst_feeds, slots, seq_lens, tables = views  # noqa: N806
        for dst, k in zip(dst_feeds, self.INPUTS):
            dst.copy_(feeds[k], non_blocking=True)
        slots.copy_(meta.slot_mapping, non_blocking=True)
        seq_lens.copy_(meta.seq_lens, non_blocking=True)
        self._pad_from(s, T)
        w = meta.block_tables.shape[1]
        table = tables.get(w)
        if table is None:
            table = tables[w] = s.block_tables[:T, :w]
        table.copy_(meta.block_tables, non_blocking=True)
        key = (B, self._cache_pointers(kv_caches))
        if key not in self._graphs:
            self._graphs[key] = self._capture(B, kv_caches)
        graph, outs = self._graphs[key]
        graph.replay()
        return [o[:T].clone() for o in outs]

    def capture_all(self, kv_caches: Any) -> int:
        """Capture the decode graph of every capture size now (at load), not on the first step of each
        size: the static inputs hold no slot (-1) and no context, so nothing is written to the KV cache."""
        if not (self.use_graphs and kv_caches is not None):
            return 0
        # replays ran before: their rows must not be captured (the warm-up would write KV there)
        self._pad_from(self._static_state(kv_caches), 0)
        pointers = self._cache_pointers(kv_caches)
        for B in self.capture_sizes:  # noqa: N806
            if (B, pointers) not in self._graphs:
                self._graphs[(B, pointers)] = self._capture(B, kv_caches)
        return len(self.capture_sizes) + self.capture_step_graphs(kv_caches)

    def graph_step_state(self, B: int, kv_caches: Any) -> tuple[StepState, dict[str, torch.Tensor]]:  # noqa: N803
        """The step state and feeds a decode graph of ``B`` sequences is captured with: views of the static
        buffers ``_replay`` copies each step's inputs into."""
        s = self._static_state(kv_caches)
        st = StepState(B, B, 0, B, 1, s.qsl[: B + 1], s.seq_lens[:B], s.slots[:B], s.block_tables[:B],
                       s.block_tables.stride(0), int(kv_caches[0][0].shape[1]), True, None, kv_caches, self.device,
                       decode_offset=0)
        return st, {k: v[:B] for k, v in s.feeds.items()}

    def _capture(self, B: int, kv_caches: Any) -> tuple[Any, list[torch.Tensor]]:  # noqa: N803
        st, feeds = self.graph_step_state(B, kv_caches)
        return self._graph_of(B, B, feeds, st, kv_caches)

    def _graph_of(self, T: int, S: int, feeds: Mapping[str, torch.Tensor], st: StepState, kv_caches: Any,  # noqa: N803
                  pool: Any = None) -> tuple[Any, list[torch.Tensor]]:
        """A CUDA graph of ``forward`` over static inputs (in ``pool`` when given) and its outputs: one warm-up
        forward on a side stream first, which compiles kernels and makes vendor GEMM handles outside the capture."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.forward(T, S, feeds, st, kv_caches)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outs = self.forward(T, S, feeds, st, kv_caches)
        return graph, outs


_HOST_DIM_CACHE: dict[str, Any] = {}


def eval_host_dim(expr: str | int, T: int, S: int) -> int:  # noqa: N803
    """A buffer dimension from program.json (an int, or + - * // over T, S and ints) for one step.
    Parsed with ``ast`` against a whitelist: artifact data is never evaluated as Python."""
    if isinstance(expr, int):
        return expr
    fn = _HOST_DIM_CACHE.get(expr)
    if fn is None:
        fn = _HOST_DIM_CACHE[expr] = _compile_dim(expr)
    return fn(T, S)


def _compile_dim(expr: str) -> Any:
    import ast

    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"program.json: buffer dimension {expr!r} is not an expression in T and S") from e
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.FloorDiv: lambda a, b: a // b}

    def build(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            v = node.value
            return lambda T, S: v  # noqa: N803
        if isinstance(node, ast.Name) and node.id in ("T", "S"):
            return (lambda T, S: T) if node.id == "T" else (lambda T, S: S)  # noqa: N803
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            f, a, b = ops[type(node.op)], build(node.left), build(node.right)
            return lambda T, S: f(a(T, S), b(T, S))  # noqa: N803
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            a = build(node.operand)
            return lambda T, S: -a(T, S)  # noqa: N803
        raise ValueError(f"program.json: buffer dimension {expr!r} uses {type(node).__name__}; only integers, T, S "
                         "and + - * // are allowed")

    return build(tree)
