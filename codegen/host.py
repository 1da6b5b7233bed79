"""The host-program generator: the fuse pass's kernel groups -> one readable Python program.

Codegen decides nothing here. For each group in ``graph.meta["kernels"]`` it calls the
lowering of the implementation the group names (passed in as ``lower``: backends/generate.py
looks it up in the registry), binds the values the lowering writes to the buffers of
``graph.meta["memory_plan"]``, and emits the group's views around it as aliases. Kernels are
deduplicated by their code. Identical layers become one method and a loop (codegen/layers.py).
The program subclasses host_support.HostProgram (Triton, torch) or cann.CannHostProgram and
exposes run().
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from portlayer.codegen.kernels.context import GenContext, host_dim
from portlayer.codegen.layers import Block, fold_layers, module_layer, straight_line
from portlayer.codegen.lowering import GroupCode, KernelGroup, Unlowerable, resolve_group
from portlayer.codegen.render import render
from portlayer.codegen.spec import KernelSpec
from portlayer.flatten.ir import Graph

LowerFn = Callable[[GenContext, KernelGroup], GroupCode]
TEMPLATES = {"triton": "host/triton_program.py.j2", "torch": "host/torch_program.py.j2", "cann": "cann/program.py.j2"}


@dataclass
class GeneratedProgram:
    """Generated sources: the host program, its kernels (module name -> spec) and its buffer table."""

    host: str
    kernels: dict[str, KernelSpec] = field(default_factory=dict)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)  # (group, reason)
    layout: dict[str, Any] = field(default_factory=dict)  # program.json (program_layout)
    merged: dict[str, list[str]] = field(default_factory=dict)  # weights concatenated at load (GroupCode.merged)
    calls: list[str] = field(default_factory=list)  # vendor calls used (CANN)
    step_bound: list[str] = field(default_factory=list)  # groups whose host lines read the step's host-side layout

    @property
    def step_graphs(self) -> bool:
        """Steps with prefill tokens may be captured as CUDA graphs (codegen/step_graphs.py): no group's launch
        depends on how the step's tokens split into sequences beyond what its kernels read on the device."""
        return not self.step_bound

    def kernel_sources(self) -> dict[str, str]:
        """One module per kernel; the decode reduce kernel lives in its decode kernel's module."""
        return {n: k.source for n, k in self.kernels.items() if "module" not in k.extra}


#: Ops that read the step's sequence layout (attention metadata), and the lowerings of them whose launches depend
#: only on the step's token and sequence counts (grids of T and S; the layout is read on the device).
STEP_OPS = ("attention", "mla_attention", "pooling")
STEP_SAFE_IMPLS = ("triton.paged_attention", "triton.mla_attention")


def weights_prefixed(lines: list[str], params: set[str]) -> list[str]:
    """Parameter names in lowering lines become W.<name> (weights live on the program)."""
    if not params:
        return lines
    pat = re.compile(r"(?<![\w.'\"])(" + "|".join(sorted(map(re.escape, params), key=len, reverse=True)) + r")\b")
    return [pat.sub(r"W.\1", ln) for ln in lines]


def buffer_table(graph: Graph) -> dict[str, Any]:
    """The memory plan's arena as host data: value -> dtype, shape (host expressions in T, S), offset."""
    mp = graph.meta.get("memory_plan")
    if not mp:
        return {}
    types = graph.value_types()
    out = {}
    for v, info in mp["buffers"].items():
        t = types[v]
        entry = {"dtype": t.dtype, "shape": [host_dim(d) for d in t.shape], "offset": int(info["offset"])}
        out[v] = entry
    return {"arena_bytes": int(mp["arena_bytes"]), "max_tokens": int(mp["max_tokens"]), "buffers": out}


def program_layout(graph: Graph, buffers: Mapping[str, Any], methods: Sequence[Any],
                   merged: Mapping[str, list[str]] | None = None, kv_cache_dtype: str | None = None) -> dict[str, Any]:
    """program.json: what the host program allocates and binds, kept out of host.py so the program's
    text does not grow with the model's depth (weights, arena buffers, per-layer namespaces, and the
    weights it concatenates when it loads)."""
    out = {"format": "portlayer-program/1", "params": {k: t.dtype for k, t in graph.params.items()},
           "arena_bytes": int(buffers.get("arena_bytes", 0)), "max_tokens": int(buffers.get("max_tokens", 0)),
           "buffers": dict(buffers.get("buffers", {})),
           "layers": [{"method": m.name, "first": m.first, "last": m.last, "params": m.params,
                       "buffers": m.buffers} for m in methods]}
    if merged:
        out["merged_weights"] = {k: list(v) for k, v in merged.items()}
    if kv_cache_dtype and graph.find("attention") + graph.find("mla_attention"):
        out["kv_cache_dtype"] = kv_cache_dtype  # the element type its attention kernels read and write the cache in
    return out


def _add_merged(out: GeneratedProgram, code: GroupCode, group: str, params: set[str]) -> None:
    for name, parts in code.merged.items():
        if name in params and out.merged.get(name) != parts:
            raise Unlowerable(f"group {group} concatenates {parts} as {name}, a name already taken "
                              f"(by {out.merged.get(name, 'a parameter')}); this is a bug in the lowering")
        out.merged[name] = list(parts)
        params.add(name)


def _group_blocks(graph: Graph, ctx: GenContext, lower: LowerFn, view_lower: LowerFn, buffered: set[str],
                  out: GeneratedProgram) -> list[Block]:
    records = graph.meta.get("kernels")
    if not records:
        raise Unlowerable("codegen consumes the pipeline's kernel groups (graph.meta['kernels']) and memory plan; "
                          "run passes.pipeline.run_pipeline(graph, target) first")
    users = graph.users()
    params = set(graph.params)
    blocks: list[Block] = []
    for rec in records:
        g = resolve_group(graph, rec, ctx.nodes, users)
        lines: list[str] = []
        if g.pre_views:
            lines += view_lower(ctx, KernelGroup(g.name, "torch.view", "view", g.pre_views[0].name, g.pre_views,
                                                 [], [])).lines
        code = lower(ctx, g) if g.nodes else GroupCode()
        _add_merged(out, code, g.name, params)
        for v in code.buffers:
            if v not in buffered:
                raise Unlowerable(f"group {g.name} ({g.impl}) writes {v}, which has no buffer in the memory plan; "
                                  "the lowering's scratch() must name it (passes/memory_plan.py places scratch)")
        lines += [f"{v} = B.{v}" for v in code.buffers] + code.lines
        if g.post_views:
            lines += view_lower(ctx, KernelGroup(g.name, "torch.view", "view", g.post_views[0].name, g.post_views,
                                                 [], [])).lines
        for k in code.kernels:
            first = out.kernels.setdefault(k.name, k)
            if first is not k:
                first.add_variant(k)
        if g.impl == "reference":
            out.fallbacks.append((g.name, f"{', '.join(n.op for n in g.nodes)}: no implementation accepted it"))
        if any(n.op in STEP_OPS for n in g.nodes) and g.impl not in STEP_SAFE_IMPLS:
            out.step_bound.append(g.name)
        members = g.pre_views + g.nodes + g.post_views
        made = [v.name for n in members for v in n.outputs]
        reads = [i for n in members for i in n.inputs if i is not None and i not in params and i not in made]
        anchor = ctx.nodes.get(g.anchor)
        layer = module_layer(anchor.meta.get("source")) if anchor is not None else None
        kv_write = rec.get("kv_write")  # a rope kernel that stores an attention's K/V (passes/fuse_kv.py)
        if kv_write:
            reads.append(kv_write["v"])
        kv = sorted({int(n.attrs.get("layer", 0)) for n in g.nodes if n.op in ("attention", "mla_attention")}
                    | ({int(kv_write["layer"])} if kv_write else set()))
        ops = ", ".join(n.op for n in g.nodes) or ", ".join(n.op for n in members)
        blocks.append(Block(f"{g.anchor}: {g.impl} [{ops}]", weights_prefixed(lines, params), made,
                            list(dict.fromkeys(reads)),
                            list(dict.fromkeys([*(i for n in members for i in n.inputs if i in params), *code.merged])),
                            layer, kv))
    return blocks


def generate_program(graph: Graph, ctx: GenContext, lower: LowerFn, view_lower: LowerFn, *, family: str,
                     target: str = "?", extra: Callable[[], Mapping[str, Any]] | None = None,
                     fold: bool = True) -> GeneratedProgram:
    """The host program (and kernels) for a pipeline-optimised graph on a ``family`` target."""
    table = buffer_table(graph) if family == "triton" else {}
    out = GeneratedProgram(host="")
    buffered = set(table.get("buffers", {}))
    blocks = _group_blocks(graph, ctx, lower, view_lower, buffered, out)
    prog = (fold_layers(blocks, list(graph.outputs), buffered, set(graph.params) | set(out.merged)) if fold
            else straight_line(blocks, list(graph.outputs)))
    out.layout = program_layout(graph, table, prog.methods, out.merged, ctx.kv_dtype)
    out.host = render(
        TEMPLATES[family], model=graph.meta.get("model_type", "model"), target=target, n_groups=len(blocks),
        kernels=sorted(out.kernel_sources()), inputs=[v.name for v in graph.inputs], outputs=prog.outputs,
        params=[(k, t.dtype) for k, t in graph.params.items()], lines=prog.lines, methods=prog.methods,
        max_positions=int(graph.meta.get("max_positions") or 4096), scratch=_scratch(out.kernels),
        n_buffers=len(table.get("buffers", {})), arena=table.get("arena_bytes", 0),
        n_kernels=len(out.kernel_sources()), fallbacks=out.fallbacks, step_graphs=out.step_graphs,
        **dict(extra() if extra else {}),
    )
    return out


def _scratch(kernels: Mapping[str, KernelSpec]) -> tuple[int, int]:
    s = (0, 0)
    for k in kernels.values():
        if "scratch" in k.extra:
            hq, splits, bd = k.extra["scratch"]
            s = (max(s[0], hq * splits * bd), max(s[1], hq * splits))
    return s
