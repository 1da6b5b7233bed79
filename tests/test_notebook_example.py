"""examples/inspect_ir.ipynb is executed here so it cannot rot; the notebook views render."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from portlayer.notebook_views import (
    KernelListView,
    MemoryPlanView,
    PlanView,
    memory_timeline,
    memory_timeline_svg,
    show,
)

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "inspect_ir.ipynb"

MEMORY_PLAN = {
    "alignment": 64,
    "buffers": {
        "h0": {"offset": 0, "size": "256*num_tokens", "start": 0, "end": 3},
        "h1": {"offset": "256*num_tokens", "size": "256*num_tokens", "start": 2, "end": 5},
        "h2": {"offset": 0, "size": "128*num_tokens", "start": 4, "end": 6},
    },
    "arena_bytes": "512*num_tokens",
    "peak_bytes": {"64": 32768},
    "no_reuse_bytes": {"64": 40960},
}
KERNELS = [
    {"name": "k0", "family": "embedding", "impl": "torch.embedding", "nodes": ["embed"], "inputs": ["input_ids"],
     "outputs": ["h0"]},
    {"name": "k1", "family": "reduction", "impl": "triton.rms_norm", "nodes": ["norm", "mul"], "inputs": ["h0"],
     "outputs": ["h1"]},
]


def test_views_render_html() -> None:
    html = MemoryPlanView(MEMORY_PLAN, num_tokens=64)._repr_html_()
    assert "h1" in html and "<svg" in html and "arena" in html
    assert html.count("<rect") == 3
    k = KernelListView(KERNELS)._repr_html_()
    assert "triton.rms_norm" in k and "2 kernels (embedding×1, reduction×1)" in k
    assert isinstance(show(KERNELS), KernelListView) and isinstance(show(MEMORY_PLAN), MemoryPlanView)


def test_plan_view_and_timeline_fallback(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from artifact_samples import sample_graph

    from portlayer.capabilities.policy import plan_for_graph

    plan = plan_for_graph(sample_graph(), "ascend-910b")
    html = PlanView(plan)._repr_html_()
    assert "kv_block_size" in html and "ascend-910b" in html
    svg = memory_timeline_svg(MEMORY_PLAN, num_tokens=8)
    assert svg.startswith("<svg") and "h0: 2.0 KiB" in svg
    view = memory_timeline(MEMORY_PLAN, num_tokens=8, use_matplotlib=False)
    assert view._repr_svg_() == svg


@pytest.mark.slow
def test_inspect_ir_notebook_executes(tmp_path: Path) -> None:
    import nbclient
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    os.environ.setdefault("PORTLAYER_CACHE", str(tmp_path / "cache"))
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert any("Plan for" in h for h in html), "the plan renders as HTML"
    assert any("portlayer-graph" in h for h in html), "the graph renders as HTML"
    text = "".join(o.get("text", "") for o in outputs)
    assert "PASSED" in text
