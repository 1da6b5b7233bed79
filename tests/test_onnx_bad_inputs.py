"""Bad ONNX input: truncated file, unknown opset, an unmapped op, missing external data -> clear
errors (OnnxImportError, a PortlayerError) and no traceback from the CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from portlayer.cli import main
from portlayer.errors import PortlayerError
from portlayer.flatten.onnx_import import UnmappedOnnxOpError, import_onnx
from portlayer.flatten.onnx_load import OnnxImportError


def _model(op: str = "Relu", opset: int = 17, weight: bool = False) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("input_ids", TensorProto.FLOAT, ["batch", 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])
    nodes, inits = [], []
    if weight:
        inits.append(numpy_helper.from_array(np.ones((64, 64), np.float32), "w"))
        nodes.append(helper.make_node("MatMul", ["input_ids", "w"], ["h"], name="proj"))
        nodes.append(helper.make_node(op, ["h"], ["y"], name="act"))
    else:
        nodes.append(helper.make_node(op, ["input_ids"], ["y"], name="act"))
    g = helper.make_graph(nodes, "g", [x], [y], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_truncated_file(tmp_path: Path) -> None:
    p = tmp_path / "m.onnx"
    onnx.save(_model(weight=True), str(p))
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(OnnxImportError, match="truncated"):
        import_onnx(p, stream=False)


def test_unknown_opset(tmp_path: Path) -> None:
    p = tmp_path / "m.onnx"
    onnx.save(_model(opset=11), str(p))
    with pytest.raises(OnnxImportError, match="opset 11 is outside"):
        import_onnx(p, stream=False)


def test_unmapped_op_names_type_node_and_position(tmp_path: Path) -> None:
    p = tmp_path / "m.onnx"
    onnx.save(_model(op="Hardmax", weight=True), str(p))
    with pytest.raises(UnmappedOnnxOpError) as e:
        import_onnx(p, stream=False)
    msg = str(e.value)
    assert "ONNX node 1" in msg and "Hardmax" in msg and "'act'" in msg and "onnx_table.py" in msg
    assert isinstance(e.value, PortlayerError)


def test_missing_external_data(tmp_path: Path) -> None:
    p = tmp_path / "m.onnx"
    onnx.save(_model(weight=True), str(p), save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.onnx.data", size_threshold=0)
    (tmp_path / "m.onnx.data").unlink()
    with pytest.raises(OnnxImportError, match="external tensor data"):
        import_onnx(p, stream=False)


def test_external_data_next_to_the_file_is_read(tmp_path: Path) -> None:
    import torch

    from portlayer.flatten.interpret import run_graph

    p = tmp_path / "m.onnx"
    onnx.save(_model(weight=True), str(p), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    g = import_onnx(p, stream=False)
    x = torch.randn(3, 64)
    assert torch.allclose(run_graph(g, {"input_ids": x})[0], torch.relu(x @ torch.ones(64, 64)), atol=1e-5)


@pytest.mark.parametrize("case", ["truncated", "opset", "unmapped"])
def test_cli_prints_the_error_without_traceback(tmp_path: Path, capsys, case: str) -> None:
    p = tmp_path / "m.onnx"
    onnx.save(_model(op="Hardmax" if case == "unmapped" else "Relu", opset=11 if case == "opset" else 17), str(p))
    if case == "truncated":
        p.write_bytes(p.read_bytes()[:-7])
    assert main(["inspect", str(p)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(p) in err


def test_reduction_across_tokens_is_refused_for_the_stream(tmp_path: Path) -> None:
    """Mean pooling written as ONNX ops sums over the whole packed stream: the self-check refuses it."""
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])
    emb = numpy_helper.from_array(np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32), "emb")
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["h"], name="lookup"),
             helper.make_node("ReduceMean", ["h"], ["y"], name="pool", axes=[1], keepdims=0)]
    p = tmp_path / "pooled.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [ids], [y], [emb]),
                                opset_imports=[helper.make_opsetid("", 17)]), str(p))
    assert import_onnx(p, stream=False).outputs  # the faithful graph is fine
    with pytest.raises(OnnxImportError, match="reduces across tokens"):
        import_onnx(p)


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum_of_floats_with_infinities_and_nans_matches_onnxruntime(tmp_path: Path, monkeypatch, exclusive: int,
                                                                        reverse: int) -> None:
    """CumSum of floats holding +-inf and nan: portlayer's import (a triangular matmul with the non-finite values
    taken out first) gives onnxruntime's infinities and nans in the same places, and its finite values; so do the
    generated programs (Triton, under the interpreter, and torch)."""
    import onnxruntime as ort
    import torch
    from triton_harness import build_program, use_interpreter

    from portlayer.flatten.interpret import run_graph

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6])
    axis = numpy_helper.from_array(np.array(1, np.int64), "axis")
    node = helper.make_node("CumSum", ["x", "axis"], ["y"], exclusive=exclusive, reverse=reverse)
    m = helper.make_model(helper.make_graph([node], "g", [x], [y], [axis]), opset_imports=[helper.make_opsetid("", 17)])
    p = tmp_path / "c.onnx"
    onnx.save(m, str(p))
    inf, nan = np.inf, np.nan
    xv = np.array([[1.5, -2.0, 3.25, 0.5, 1.0, 2.0], [1.0, inf, 2.0, -1.0, 3.0, 1.0],
                   [1.0, 2.0, -inf, 1.0, inf, 2.0], [nan, 1.0, 2.0, 3.0, 4.0, 5.0]], np.float32)
    want = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": xv})[0]
    g = import_onnx(p, stream=False)
    (ref,) = run_graph(g, {g.inputs[0].name: torch.from_numpy(xv)}, None)
    use_interpreter(monkeypatch)
    runs = {"interpreter": ref}
    for target in ("nvidia-h200", "cpu-x86_64"):
        _, prog = build_program(g, tmp_path / target, target=target)
        (runs[target],) = prog.run({g.inputs[0].name: torch.from_numpy(xv)}, None, None)
    fin = np.isfinite(want)
    for name, ours in runs.items():
        ours = ours.cpu().numpy()
        assert np.array_equal(np.isnan(ours), np.isnan(want)) and np.array_equal(np.isinf(ours), np.isinf(want)), name
        assert np.array_equal(ours[np.isinf(want)], want[np.isinf(want)]), name
        np.testing.assert_allclose(ours[fin], want[fin], rtol=1e-6, atol=1e-6, err_msg=name)
