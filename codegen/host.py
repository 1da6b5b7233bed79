"""The host-program generator: kernel groups -> readable Python that runs one step.

For Triton targets each group becomes kernels (deduplicated by source, so identical
transformer layers share them) plus launch statements; values that kernels write get
planned arena buffers. For the CPU family ('torch') every node is a call of its reference
implementation. Both programs subclass host_support.HostProgram and expose run().
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from portlayer.codegen.buffers import plan_buffers
from portlayer.codegen.expr import Unsupported
from portlayer.codegen.groups import default_groups, group_record, kernel_groups
from portlayer.codegen.kernels.attention import build_attention
from portlayer.codegen.kernels.context import GenContext, GroupCode, host_dim
from portlayer.codegen.kernels.embedding import build_embedding
from portlayer.codegen.kernels.fallback import build_reference, build_view
from portlayer.codegen.kernels.gemm import build_gemm
from portlayer.codegen.kernels.pointwise import build_pointwise
from portlayer.codegen.kernels.reduction import build_reduction
from portlayer.codegen.kernels.rope import build_rope
from portlayer.codegen.render import render
from portlayer.codegen.spec import KernelSpec
from portlayer.flatten.ir import Graph

BUILDERS = {
    "pointwise": build_pointwise, "reduction": build_reduction, "rope": build_rope, "embedding": build_embedding,
    "gemm": build_gemm, "attention": build_attention, "view": build_view,
}  # fmt: skip


@dataclass
class GeneratedProgram:
    """Generated sources: the host program and its kernels (module name -> source)."""

    host: str
    kernels: dict[str, KernelSpec] = field(default_factory=dict)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)  # (group, reason)

    def kernel_sources(self) -> dict[str, str]:
        """One module per kernel; the decode reduce kernel lives in its decode kernel's module."""
        return {n: k.source for n, k in self.kernels.items() if "module" not in k.extra}


def _weights_prefixed(lines: list[str], params: set[str]) -> list[str]:
    """Parameter names in builder lines become W.<name> (weights live on the program)."""
    if not params:
        return lines
    pat = re.compile(r"(?<![\w.])(" + "|".join(sorted(map(re.escape, params), key=len, reverse=True)) + r")\b")
    return [pat.sub(r"W.\1", ln) for ln in lines]


def generate_triton_program(graph: Graph, ctx: GenContext, *, target: str = "?",
                            kernels_dir: str = "kernels") -> GeneratedProgram:
    groups = kernel_groups(graph)
    out = GeneratedProgram(host="")
    codes: list[tuple[dict[str, Any], GroupCode]] = []
    for g in groups:
        codes += _realise(graph, ctx, g, out)
    aliases: dict[str, str] = {}
    for g, _ in codes:
        if g["family"] == "view":
            for name in g["nodes"]:
                n = ctx.nodes[name]
                if n.op == "reshape":
                    aliases[n.outputs[0].name] = aliases.get(n.inputs[0], n.inputs[0])
    written = [c.buffers for _, c in codes]
    reads = [[i for i in g["inputs"]] for g, _ in codes]
    bufs, arena = plan_buffers(ctx.types, written, reads, aliases, list(graph.outputs), graph.meta.get("memory_plan"),
                               graph.meta.get("token_symbol", "num_tokens"))
    arena_values = {b.value for b in bufs}
    params = set(graph.params)
    rendered_groups = []
    scratch = (0, 0)
    for g, code in codes:
        for k in code.kernels:
            out.kernels.setdefault(k.name, k)
            if "scratch" in k.extra:
                hq, splits, bd = k.extra["scratch"]
                scratch = (max(scratch[0], hq * splits * bd), max(scratch[1], hq * splits))
        binds = [f"{v} = B.{v}" if v in arena_values else _alloc(v, ctx) for v in code.buffers]
        title = f"{g['name']}: {g['family']} [{', '.join(ctx.nodes[n].op for n in g['nodes'])}]"
        rendered_groups.append({"title": title, "lines": binds + _weights_prefixed(code.lines, params)})
    host = render(
        "host/triton_program.py.j2", model=graph.meta.get("model_type", "model"), target=target,
        n_launch=len(groups), n_buffers=len(bufs), arena=arena, n_kernels=len(out.kernels), kernels_dir=kernels_dir,
        kernels=sorted(out.kernel_sources()), buffers=bufs, scratch=scratch, inputs=[v.name for v in graph.inputs],
        outputs=list(graph.outputs), params=[(k, t.dtype) for k, t in graph.params.items()], groups=rendered_groups,
        max_positions=int(graph.meta.get("max_positions") or 4096),
    )
    out.host = host
    return out


def _alloc(value: str, ctx: GenContext) -> str:
    """A value outside the arena (not [num_tokens, ...]): allocated in the step."""
    t = ctx.types[value]
    shape = ", ".join(host_dim(d) for d in t.shape)
    return f"{value} = torch.empty(({shape},), dtype=torch.{t.dtype}, device=self.device)  # not per-token: per step"


def _build(ctx: GenContext, g: dict[str, Any]) -> GroupCode:
    builder = BUILDERS.get(g["family"])
    if builder is None or g.get("impl_family", "triton") == "torch":
        raise Unsupported(f"no Triton template for family {g['family']!r}")
    try:
        return builder(ctx, g)
    except ValueError as e:  # a builder's shape expectations (e.g. one node) not met
        raise Unsupported(f"{g['family']} template does not take {g['nodes']}: {e}") from e


def _realise(graph: Graph, ctx: GenContext, g: dict[str, Any], out: GeneratedProgram):
    """Build a group; a fused group no template takes whole (e.g. the fuse pass's
    q/k-norm + rope, or a GEMM with a trailing reshape) is split into default groups, and
    only what no template takes runs as the reference op (recorded in ``out.fallbacks``)."""
    try:
        return [(g, _build(ctx, g))]
    except Unsupported as e:
        whole_reason = str(e)
    if len(g["nodes"]) > 1:
        names = set(g["nodes"])
        sub = Graph(inputs=graph.inputs, params=graph.params, nodes=[n for n in graph.nodes if n.name in names],
                    outputs=list(g["outputs"]), meta=graph.meta)
        parts = [group_record(graph, p["nodes"], p["family"], name=p["name"]) for p in default_groups(sub)]
        if len(parts) > 1:
            return [pair for p in parts for pair in _realise(graph, ctx, p, out)]
    if g["family"] not in ("view", "torch", "pooling"):
        out.fallbacks.append((g["name"], whole_reason))
    return [(g, build_reference(ctx, g, reason=whole_reason))]


def generate_torch_program(graph: Graph, *, target: str = "cpu") -> GeneratedProgram:
    """The CPU family's program: reference op calls in graph order (reshapes as views)."""
    ctx = GenContext(graph, {})
    lines: list[str] = []
    for n in graph.nodes:
        if n.op == "reshape":
            shape = ", ".join(host_dim(d) for d in n.outputs[0].type.shape)
            lines.append(f"{n.outputs[0].name} = {n.inputs[0]}.reshape({shape})")
        else:
            lines += build_reference(ctx, {"nodes": [n.name]}).lines
    lines = _weights_prefixed(lines, set(graph.params))
    host = render("host/torch_program.py.j2", model=graph.meta.get("model_type", "model"), target=target,
                  inputs=[v.name for v in graph.inputs], outputs=list(graph.outputs), lines=lines,
                  params=[(k, t.dtype) for k, t in graph.params.items()],
                  max_positions=int(graph.meta.get("max_positions") or 4096))
    return GeneratedProgram(host=host)
