"""Rich notebook views of the compiler's decisions: the Plan, the memory plan, the kernel list.

Each view is a small object with ``_repr_html_`` so a cell showing it renders a table;
the memory-plan timeline draws each buffer as a box (lifetime × address range) with
matplotlib when it is installed and as hand-written SVG otherwise, so it works on a bare
machine. The Graph's own view lives in flatten/notebook.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from portlayer.capabilities.plan_view import _e, _table, plan_html  # noqa: F401 - re-exported for notebooks


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# ---- memory plan -------------------------------------------------------------------------------
def _eval(x: Any, num_tokens: int) -> int:
    from portlayer.flatten.ir import eval_dim

    return eval_dim(x, {"num_tokens": num_tokens, "num_seqs": 1})


@dataclass(frozen=True)
class Box:
    name: str
    start: int
    end: int
    offset: int
    size: int


def memory_boxes(mp: Mapping[str, Any], num_tokens: int) -> list[Box]:
    """Buffers of a memory plan (docs/contracts.md) with sizes evaluated at ``num_tokens``."""
    return [
        Box(name, int(b["start"]), int(b["end"]), _eval(b["offset"], num_tokens), _eval(b["size"], num_tokens))
        for name, b in mp.get("buffers", {}).items()
    ]


def memory_plan_html(mp: Mapping[str, Any], num_tokens: int = 128) -> str:
    boxes = sorted(memory_boxes(mp, num_tokens), key=lambda b: (b.start, b.offset))
    arena = max((b.offset + b.size for b in boxes), default=0)
    naive = sum(b.size for b in boxes)
    peaks = ", ".join(f"{k}: {_fmt_bytes(v)}" for k, v in mp.get("peak_bytes", {}).items()) or "-"
    head = (f"<p>alignment {mp.get('alignment')} B · arena {_e(mp.get('arena_bytes'))} "
            f"= {_fmt_bytes(arena)} at num_tokens={num_tokens} · without reuse {_fmt_bytes(naive)} · peak {_e(peaks)}</p>")
    rows = [(b.name, _fmt_bytes(b.offset), _fmt_bytes(b.size), f"{b.start}..{b.end}") for b in boxes]
    return head + _table(("value", "offset", "size", "live (node index)"), rows, "Memory plan")


def memory_timeline_svg(mp: Mapping[str, Any], num_tokens: int = 128, width: int = 720, height: int = 320) -> str:
    """Buffers as boxes: x = node index (lifetime), y = arena offset. Pure SVG, no dependencies."""
    boxes = memory_boxes(mp, num_tokens)
    if not boxes:
        return "<svg xmlns='http://www.w3.org/2000/svg' width='200' height='20'><text y='14'>empty memory plan</text></svg>"
    x_max = max(b.end for b in boxes) + 1
    y_max = max(b.offset + b.size for b in boxes) or 1
    left, bottom = 60, 20
    sx, sy = (width - left - 10) / x_max, (height - bottom - 10) / y_max
    palette = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7")
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' font-size='10'>"]
    for i, b in enumerate(boxes):
        x, w = left + b.start * sx, max((b.end - b.start + 1) * sx, 1)
        y, h = height - bottom - (b.offset + b.size) * sy, max(b.size * sy, 1)
        parts.append(f"<rect x='{x:.1f}' y='{y:.1f}' width='{w:.1f}' height='{h:.1f}' fill='{palette[i % 8]}' "
                     f"fill-opacity='0.7' stroke='#333' stroke-width='0.5'><title>{_e(b.name)}: "
                     f"{_fmt_bytes(b.size)} @ {_fmt_bytes(b.offset)}, nodes {b.start}..{b.end}</title></rect>")
    parts.append(f"<line x1='{left}' y1='{height - bottom}' x2='{width - 10}' y2='{height - bottom}' stroke='black'/>")
    parts.append(f"<line x1='{left}' y1='10' x2='{left}' y2='{height - bottom}' stroke='black'/>")
    parts.append(f"<text x='{left}' y='{height - 5}'>node 0</text>")
    parts.append(f"<text x='{width - 60}' y='{height - 5}'>node {x_max - 1}</text>")
    parts.append(f"<text x='2' y='14'>{_e(_fmt_bytes(y_max))}</text><text x='2' y='{height - bottom}'>0</text>")
    parts.append("</svg>")
    return "".join(parts)


def memory_timeline(mp: Mapping[str, Any], num_tokens: int = 128, use_matplotlib: bool | None = None) -> Any:
    """A matplotlib Figure when matplotlib is installed (or asked for), else an SVG view."""
    if use_matplotlib is not False:
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            if use_matplotlib:
                raise
        else:
            fig, ax = plt.subplots(figsize=(9, 4))
            for b in memory_boxes(mp, num_tokens):
                ax.add_patch(plt.Rectangle((b.start, b.offset), b.end - b.start + 1, b.size, alpha=0.6, ec="k"))
            boxes = memory_boxes(mp, num_tokens)
            ax.set_xlim(0, max((b.end for b in boxes), default=0) + 1)
            ax.set_ylim(0, max((b.offset + b.size for b in boxes), default=1))
            ax.set_xlabel("node index")
            ax.set_ylabel(f"arena offset (bytes, num_tokens={num_tokens})")
            ax.set_title("memory plan")
            return fig
    return SVGView(memory_timeline_svg(mp, num_tokens))


# ---- kernels ------------------------------------------------------------------------------
def kernels_html(kernels: Sequence[Mapping[str, Any]]) -> str:
    rows = [
        (i, k.get("name"), k.get("family"), k.get("impl"), len(k.get("nodes", [])), ", ".join(k.get("nodes", [])),
         ", ".join(k.get("inputs", [])), ", ".join(k.get("outputs", [])))
        for i, k in enumerate(kernels)
    ]
    families: dict[str, int] = {}
    for k in kernels:
        families[k.get("family", "?")] = families.get(k.get("family", "?"), 0) + 1
    summary = ", ".join(f"{f}×{n}" for f, n in families.items())
    return _table(("#", "kernel", "family", "impl", "nodes", "node names", "reads", "writes"), rows,
                  f"{len(kernels)} kernels ({summary})")


# ---- view objects --------------------------------------------------------------------------
@dataclass
class SVGView:
    svg: str

    def _repr_svg_(self) -> str:
        return self.svg

    def _repr_html_(self) -> str:
        return self.svg


@dataclass
class PlanView:
    plan: Any

    def _repr_html_(self) -> str:
        return plan_html(self.plan)


@dataclass
class MemoryPlanView:
    memory_plan: Mapping[str, Any]
    num_tokens: int = 128

    def _repr_html_(self) -> str:
        return memory_plan_html(self.memory_plan, self.num_tokens) + memory_timeline_svg(self.memory_plan, self.num_tokens)


@dataclass
class KernelListView:
    kernels: Sequence[Mapping[str, Any]]

    def _repr_html_(self) -> str:
        return kernels_html(self.kernels)


def show(obj: Any) -> Any:
    """The richest view of a Plan, a Graph's memory plan / kernels, or a pipeline result."""
    if hasattr(obj, "decisions") and hasattr(obj, "table"):
        return PlanView(obj)
    if isinstance(obj, Mapping) and "buffers" in obj:
        return MemoryPlanView(obj)
    if isinstance(obj, Sequence) and obj and isinstance(obj[0], Mapping) and "family" in obj[0]:
        return KernelListView(obj)
    return obj
