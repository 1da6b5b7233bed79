"""Snapshots of generated source (kernels and host program of tiny Qwen3 through the pass pipeline for the H200)
catch unintended changes. After an intended change:

    PORTLAYER_UPDATE_GOLDEN=1 pytest tests/test_codegen_golden.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden" / "triton"
UPDATE = os.environ.get("PORTLAYER_UPDATE_GOLDEN") == "1"


@pytest.fixture(scope="module")
def generated(captured):
    from portlayer.backends.generate import generate
    from portlayer.passes.pipeline import run_pipeline

    graph = captured["tiny-qwen3"]
    r = run_pipeline(graph, "nvidia-h200")  # the pipeline's output, as `portlayer compile` generates it
    gen = generate(r.graph, r.plan, r.descriptor)
    files: dict[str, str] = {}
    for src in sorted(gen.kernel_sources().values()):  # named without the digest, so a change shows as a diff
        fn = next(line for line in src.splitlines() if line.startswith("def ")).split("(")[0][4:]
        stem = fn.rsplit("_", 1)[0]
        key = stem if f"{stem}.py" not in files else f"{stem}_{len(files)}"
        files[f"{key}.py"] = src
    files["host_tiny_qwen3_h200.py"] = gen.host.replace(str(graph.meta.get("source", "")), "<source>")
    return files


def test_generated_source_matches_golden(generated):
    if UPDATE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for old in GOLDEN.glob("*.py"):
            old.unlink()
        for name, src in generated.items():
            (GOLDEN / name).write_text(src)
    missing = sorted(set(generated) - {p.name for p in GOLDEN.glob("*.py")})
    assert not missing, f"no snapshot for {missing}; run with PORTLAYER_UPDATE_GOLDEN=1"
    changed = [n for n, src in generated.items() if (GOLDEN / n).read_text() != src]
    assert not changed, f"generated source changed: {changed}; review, then PORTLAYER_UPDATE_GOLDEN=1"
