"""Notebook views: the HTML summary, Graphviz DOT and SVG (pure-Python fallback)."""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET

import pytest
from ir_samples import tiny_decoder

from portlayer.flatten.notebook import graph_dot, graph_html, graph_svg, layered_svg

SVG = "{http://www.w3.org/2000/svg}"


def test_html_summary() -> None:
    g = tiny_decoder()
    html = graph_html(g)
    assert g._repr_html_() == html
    assert "<th style='text-align:left'>nodes</th><td style='text-align:left'>23</td>" in html
    assert "linear×8" in html and "rms_norm×3" in html and "attention×1" in html
    n_params = 32 * 16 * 2 + 64 * 4 + 16 * 3 + 16 * 16 * 2 + 8 * 16 * 2 + 24 * 16 * 3
    assert f"13 ({n_params * 4 / 1024:.1f} KiB)" in html
    assert "input_ids: int64[num_tokens], positions: int64[num_tokens]" in html
    assert "logits: float32[num_tokens, 32]" in html
    assert "<pre" in html and "def forward(input_ids: int64[num_tokens]" in html


def test_html_truncates_and_escapes() -> None:
    g = tiny_decoder()
    html = graph_html(g, preview_lines=5)
    assert "(34 more lines)" in html and "q_proj = linear" not in html
    g.nodes[0].attrs["note"] = "<b>"  # printed as an (unknown) attr, so it reaches the <pre>
    html = graph_html(g)
    assert "note='&lt;b&gt;'" in html and "<b>" not in html


def _dot_vertices_and_edges(dot: str) -> tuple[set[str], list[tuple[str, str]]]:
    verts = set(re.findall(r'^  "([^"]+)" \[label=', dot, re.M))
    edges = re.findall(r'^  "([^"]+)" -> "([^"]+)";', dot, re.M)
    return verts, edges


def test_dot_structure_and_labels() -> None:
    g = tiny_decoder()
    dot = graph_dot(g)
    assert dot.startswith("digraph flat_ir {") and dot.rstrip().endswith("}")
    verts, edges = _dot_vertices_and_edges(dot)
    assert verts == {"input_ids", "positions", "output:logits"} | {n.name for n in g.nodes}
    # every non-param node input is one edge, plus one edge into the output vertex
    n_edges = sum(1 for n in g.nodes for i in n.inputs if i is not None and i not in g.params) + 1
    assert len(edges) == n_edges
    assert ("k_rot", "attn") in edges and ("positions", "q_rot") in edges and ("logits", "output:logits") in edges
    assert '"q_proj" [label="q_proj = linear\\nfloat32[num_tokens, 16]", shape=box];' in dot
    assert '"embedding' not in dot  # no param vertices unless asked
    with_params = graph_dot(g, include_params=True)
    assert '"model_norm_weight" [label="model_norm_weight\\nfloat32[16]", shape=note];' in with_params


def test_svg_fallback_is_valid_and_layered() -> None:
    g = tiny_decoder()
    svg = layered_svg(g)
    root = ET.fromstring(svg)
    groups = root.findall(f"{SVG}g")
    assert len(groups) == len(g.nodes) + 3  # nodes, two inputs, one output
    assert len(root.findall(f"{SVG}line")) == len(_dot_vertices_and_edges(graph_dot(g))[1])
    ys = {}
    for grp in groups:
        label = grp.find(f"{SVG}text").text.split(" = ")[0]
        ys[label] = float(grp.find(f"{SVG}rect").get("y"))
    assert ys["input_ids"] < ys["embed_tokens"] < ys["q_proj"] < ys["attn"] < ys["logits"]
    assert ys["q_proj"] == ys["k_proj"] == ys["v_proj"]  # siblings share a layer


@pytest.mark.skipif(shutil.which("dot") is not None, reason="graphviz is installed; the fallback path is not taken")
def test_svg_without_graphviz() -> None:
    g = tiny_decoder()
    assert graph_svg(g) == layered_svg(g)
    with pytest.raises(RuntimeError, match="'dot' binary is not on PATH"):
        graph_svg(g, use_dot=True)


@pytest.mark.skipif(shutil.which("dot") is None, reason="the Graphviz 'dot' binary is not installed")
def test_svg_with_graphviz() -> None:
    svg = graph_svg(tiny_decoder(), use_dot=True)
    assert ET.fromstring(svg[svg.index("<svg"):]).tag == f"{SVG}svg"
