"""MLIR out: Flat IR -> torch-mlir (FX importer) -> IREE llvm-cpu, compared with the reference interpreter."""

from __future__ import annotations

import pytest

from portlayer.flatten import capture
from portlayer.flatten.to_mlir import MlirExportError, export_mlir, iree_check, parse_check


@pytest.fixture(scope="module")
def qwen3():
    return capture("tiny-qwen3")


def test_tiny_qwen3_linalg_parses_and_runs_on_iree_llvm_cpu(qwen3) -> None:
    text = export_mlir(qwen3, "linalg")
    assert "func.func @forward(%arg0: tensor<?xi64>, %arg1: tensor<?xi64>) -> tensor<?x256xf32>" in text
    assert "!torch.vtensor" not in text and "torch.aten" not in text  # lowered: no torch dialect left
    parse_check(text)  # torch-mlir's own parser
    results = iree_check(qwen3, text, "linalg", lengths=(1, 9, 40))
    assert [r.tokens for r in results] == [1, 9, 40] and all(r.max_abs <= 1e-4 for r in results)


def test_bad_dialect_is_a_clear_error(qwen3) -> None:
    with pytest.raises(MlirExportError, match="not one of torch, linalg"):
        export_mlir(qwen3, "stablehlo")
