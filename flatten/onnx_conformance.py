"""Run the onnx package's own node tests (onnx.backend.test) through the import and the interpreter.

Each case is a one-node model with inputs and expected outputs. The import folds shape operands
(Reshape's shape, Slice's bounds, reduction axes ...) at import time, as exported models hold
them as constants; node tests feed them as graph inputs, so the harness turns exactly those
inputs into initializers carrying the test's own values (``STATIC_INPUTS``) before importing.
Everything else runs as run-time data through the portable ops' reference implementations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: input slots the import needs as constants, per ONNX op type
STATIC_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Slice": (1, 2, 3, 4), "Unsqueeze": (1,), "Squeeze": (1,), "Expand": (1,),
    "ConstantOfShape": (0,), "Range": (0, 1, 2), "CumSum": (1,), "Split": (1,), "ReduceMean": (1,),
    "ReduceSum": (1,), "ReduceMax": (1,), "ReduceMin": (1,), "Dropout": (1, 2),
}


@dataclass
class CaseResult:
    name: str
    op_type: str
    ok: bool
    reason: str = ""


def _static_model(model: Any, inputs: list[np.ndarray]) -> tuple[Any, dict[str, np.ndarray]]:
    """The model with the op's shape operands as initializers; the remaining feeds by name."""
    import onnx
    from onnx import numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = [i.name for i in m.graph.input]
    feeds = dict(zip(names, inputs))
    static: set[str] = set()
    for n in m.graph.node:
        for slot in STATIC_INPUTS.get(n.op_type, ()):
            if slot < len(n.input) and n.input[slot] in feeds:
                static.add(n.input[slot])
    for name in static:
        m.graph.initializer.append(numpy_helper.from_array(np.asarray(feeds.pop(name)), name))
    keep = [i for i in m.graph.input if i.name not in static]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    return m, feeds


def run_case(case: Any) -> CaseResult:
    """Import ``case.model`` and compare every data set's outputs with the expected ones."""
    import torch

    from portlayer.errors import PortlayerError
    from portlayer.flatten.interpret import run_graph
    from portlayer.flatten.onnx_cleanup import cleanup
    from portlayer.flatten.onnx_import import OnnxConverter

    op_type = case.model.graph.node[0].op_type if len(case.model.graph.node) == 1 else "+".join(
        sorted({n.op_type for n in case.model.graph.node}))
    try:
        for inputs, expected in case.data_sets:
            inputs, expected = [_array(x) for x in inputs], [_array(x) for x in expected]
            if any(not isinstance(x, np.ndarray) or x.dtype.kind not in "fiub" for x in list(inputs) + list(expected)):
                return CaseResult(case.name, op_type, False, "an input or output dtype the Flat IR does not hold")
            model, feeds = _static_model(case.model, list(inputs))
            g = cleanup(OnnxConverter(model, case.name).run())
            got = run_graph(g, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in feeds.items()})
            for k, (a, e) in enumerate(zip(got, expected)):
                a = a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
                if a.shape != e.shape:
                    return CaseResult(case.name, op_type, False, f"output {k}: shape {a.shape}, expected {e.shape}")
                if e.dtype.kind in "fc":
                    np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64), rtol=max(case.rtol, 1e-5),
                                               atol=max(case.atol, 1e-6))
                elif not np.array_equal(a, e):
                    return CaseResult(case.name, op_type, False, f"output {k}: values differ")
    except PortlayerError as e:
        return CaseResult(case.name, op_type, False, str(e).split("): ", 1)[-1][:160])
    except AssertionError as e:
        return CaseResult(case.name, op_type, False, "values differ: " + str(e).strip().splitlines()[-1][:120])
    except Exception as e:  # a failure of one case is a row in the report, whatever it is
        return CaseResult(case.name, op_type, False, f"{type(e).__name__}: {str(e)[:160]}")
    return CaseResult(case.name, op_type, True)


def _array(x: Any) -> Any:
    """Test data as numpy (TensorProto for dtypes numpy lacks: kept as an object, reported unsupported)."""
    import onnx
    from onnx import numpy_helper

    if isinstance(x, onnx.TensorProto):
        try:
            return numpy_helper.to_array(x)
        except Exception:  # float8 / int4 / ...: numpy cannot hold them
            return x
    return np.asarray(x) if not isinstance(x, np.ndarray) else x


def collect(modules: list[str] | None = None) -> list[Any]:
    """onnx's node test cases: all of them (slow: every generator runs), or those of some modules."""
    import importlib
    import warnings

    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if modules is None:
            return list(node.collect_testcases(None))
        for m in modules:
            importlib.import_module(f"onnx.backend.test.case.node.{m}")
    return list(node._NodeTestCases)
