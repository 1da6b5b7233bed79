"""Notebook views of a graph: an HTML summary (Graph._repr_html_), Graphviz DOT and SVG.

SVG uses the ``dot`` binary when it is installed and otherwise a small layered layout in
pure Python, so a drawing works on a bare machine too.
"""

from __future__ import annotations

import html
import shutil
import subprocess

from portlayer.flatten.ir import Graph

PREVIEW_LINES = 40


def _fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def graph_html(graph: Graph, *, preview_lines: int = PREVIEW_LINES) -> str:
    """A summary table (nodes, op counts, params, inputs/outputs) and the start of the printout."""
    from portlayer.flatten.printer import print_graph

    types = graph.value_types()
    param_bytes = sum(t.nbytes() for t in graph.params.values() if t.is_static)
    rows = [
        ("nodes", str(len(graph.nodes))),
        ("ops", ", ".join(f"{op}×{c}" for op, c in graph.op_counts().items()) or "—"),
        ("params", f"{len(graph.params)} ({_fmt_bytes(param_bytes)})"),
        ("inputs", ", ".join(f"{v.name}: {v.type}" for v in graph.inputs) or "—"),
        ("outputs", ", ".join(f"{o}: {types[o]}" if o in types else f"{o}: ?" for o in graph.outputs) or "—"),
    ]
    body = "".join(
        f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>{html.escape(v)}</td></tr>"
        for k, v in rows
    )
    lines = print_graph(graph).splitlines()
    shown = lines[:preview_lines]
    if len(lines) > preview_lines:
        shown.append(f"    ... ({len(lines) - preview_lines} more lines)")
    pre = html.escape("\n".join(shown), quote=False)
    return (
        "<div class='portlayer-graph'><table>" + body + "</table>"
        f"<pre style='font-size:11px'>{pre}</pre></div>"
    )


def _dot_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _labels(graph: Graph, include_params: bool):
    """(networkx DiGraph, {vertex: label}, {vertex: kind}) shared by the DOT and SVG views."""
    g = graph.to_networkx()
    if not include_params:
        g.remove_nodes_from([v for v, d in list(g.nodes(data=True)) if d.get("kind") == "param"])
    node_types = {n.name: ", ".join(str(v.type) for v in n.outputs) for n in graph.nodes}
    labels, kinds = {}, {}
    for v, d in g.nodes(data=True):
        kind = d.get("kind", "node")
        kinds[v] = kind
        if kind == "node":
            op = d.get("op", "?")
            head = op if v == op else f"{v} = {op}"
            labels[v] = f"{head}\n{node_types.get(v, '')}"
        elif kind == "output":
            labels[v] = f"return {v.split(':', 1)[1]}"
        else:
            labels[v] = f"{v}\n{d.get('type', '')}"
    return g, labels, kinds


_DOT_SHAPES = {"input": "ellipse", "param": "note", "output": "ellipse", "node": "box"}


def graph_dot(graph: Graph, *, include_params: bool = False) -> str:
    """Graphviz DOT of the dataflow (from Graph.to_networkx); params are left out unless asked."""
    g, labels, kinds = _labels(graph, include_params)
    out = ["digraph flat_ir {", "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
    for v in g.nodes:
        style = ', style=filled, fillcolor="#eef3ff"' if kinds[v] in ("input", "output") else ""
        out.append(f"  {_dot_str(v)} [label={_dot_str(labels[v])}, shape={_DOT_SHAPES[kinds[v]]}{style}];")
    for a, b in g.edges:
        out.append(f"  {_dot_str(a)} -> {_dot_str(b)};")
    out.append("}")
    return "\n".join(out) + "\n"


def graph_svg(graph: Graph, *, include_params: bool = False, use_dot: bool | None = None) -> str:
    """SVG drawing: Graphviz ``dot`` when present (or ``use_dot=True``), else a pure-Python layout."""
    dot = shutil.which("dot")
    if use_dot is None:
        use_dot = dot is not None
    if use_dot:
        if dot is None:
            raise RuntimeError("use_dot=True but the Graphviz 'dot' binary is not on PATH; install graphviz")
        res = subprocess.run([dot, "-Tsvg"], input=graph_dot(graph, include_params=include_params),
                             capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"dot -Tsvg failed ({res.returncode}): {res.stderr.strip()}")
        return res.stdout
    return layered_svg(graph, include_params=include_params)


def layered_svg(graph: Graph, *, include_params: bool = False) -> str:
    """A top-down layered drawing: a vertex sits one layer below its deepest input."""
    import networkx as nx

    g, labels, kinds = _labels(graph, include_params)
    layer: dict[str, int] = {}
    for v in nx.topological_sort(g):
        layer[v] = max((layer[p] + 1 for p in g.predecessors(v)), default=0)
    rows: dict[int, list[str]] = {}
    for v in g.nodes:  # insertion order: inputs, params, nodes in program order
        rows.setdefault(layer[v], []).append(v)
    char_w, line_h, pad, gap_x, gap_y = 6.6, 13, 8, 24, 36
    size = {v: (max(len(s) for s in labels[v].split("\n")) * char_w + 2 * pad,
                len(labels[v].split("\n")) * line_h + pad) for v in g.nodes}
    pos: dict[str, tuple[float, float]] = {}
    y = 10.0
    width = 0.0
    for r in sorted(rows):
        prev_x = {v: pos[v][0] + size[v][0] / 2 for v in pos}
        # order each row by the mean position of its inputs, which untangles most edges
        row = sorted(rows[r], key=lambda v: sum(prev_x[p] for p in g.predecessors(v)) / max(1, g.in_degree(v)))
        x = 10.0
        for v in row:
            pos[v] = (x, y)
            x += size[v][0] + gap_x
        width = max(width, x)
        y += max(size[v][1] for v in row) + gap_y
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{y:.0f}" '
        f'font-family="monospace" font-size="11">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6" '
        'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
    ]
    for a, b in g.edges:
        (ax, ay), (bx, by) = pos[a], pos[b]
        x1, y1 = ax + size[a][0] / 2, ay + size[a][1]
        x2, y2 = bx + size[b][0] / 2, by
        parts.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="#555" '
                     'marker-end="url(#arrow)"/>')
    fills = {"input": "#eef3ff", "output": "#eef3ff", "param": "#f6f6f6", "node": "#ffffff"}
    for v in g.nodes:
        (x, yy), (w, h) = pos[v], size[v]
        rx = h / 2 if kinds[v] in ("input", "output") else 3
        parts.append(f'<g class="{kinds[v]}"><rect x="{x:.1f}" y="{yy:.1f}" width="{w:.1f}" height="{h:.1f}" '
                     f'rx="{rx:.1f}" fill="{fills[kinds[v]]}" stroke="#333"/>')
        for k, line in enumerate(labels[v].split("\n")):
            ty = yy + pad / 2 + (k + 1) * line_h - 3
            parts.append(f'<text x="{x + w / 2:.1f}" y="{ty:.1f}" text-anchor="middle">{html.escape(line)}</text>')
        parts.append("</g>")
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
