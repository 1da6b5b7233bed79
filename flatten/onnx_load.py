"""Read an ONNX file into a checked ModelProto: the failures a user can fix are named here.

An ONNX file is untrusted input: it is parsed by the onnx package's protobuf reader (nothing
in it is executed), external tensor data is looked up only inside the model's own directory
(onnx's loader refuses paths that escape it), and each failure names the file and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from portlayer.errors import PortlayerError

#: the default-domain opsets the import table is written against (ONNX's own numbering)
MIN_OPSET = 13
MAX_OPSET = 23


class OnnxImportError(PortlayerError, ValueError):
    """An ONNX model that portlayer cannot import; the message names the file, node and fix."""


def default_opset(model: Any) -> int:
    """The model's version of the default ('' / ai.onnx) domain."""
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    raise OnnxImportError("the model imports no default-domain opset (opset_import has no '' / 'ai.onnx' entry)")


def load_onnx(path: str | Path) -> Any:
    """ModelProto of ``path`` with external data loaded; OnnxImportError on anything unusable."""
    try:
        import onnx
        from google.protobuf.message import DecodeError
    except ImportError as e:
        raise OnnxImportError(f"{path}: reading ONNX files needs the onnx package ({e}); "
                              "pip install 'portlayer[onnx]'") from None

    p = Path(path)
    if not p.is_file():
        raise OnnxImportError(f"{p}: no such ONNX file")
    try:
        model = onnx.load(str(p), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as e:
        raise OnnxImportError(
            f"{p}: not a readable ONNX model ({type(e).__name__}: {str(e)[:200]}); the file is truncated or is not "
            "ONNX, export or copy it again") from None
    if not model.graph.node and not model.graph.output:
        raise OnnxImportError(f"{p}: the ONNX graph is empty (truncated file?); export or copy it again")
    _check_opset(p, model)
    from onnx.checker import ValidationError

    try:
        onnx.load_external_data_for_model(model, str(p.parent))
    except (OSError, ValueError, RuntimeError, ValidationError) as e:
        missing = [t.name for t in model.graph.initializer if _is_external(t)]
        raise OnnxImportError(
            f"{p}: external tensor data could not be read ({type(e).__name__}: {str(e)[:200]}); tensors stored "
            f"outside the file: {', '.join(missing[:5])}. Copy the data file(s) next to the .onnx file "
            "(the paths are relative to it).") from None
    for t in model.graph.initializer:
        if _is_external(t):
            raise OnnxImportError(f"{p}: initializer {t.name!r} still points at external data; copy its file beside the model")
    return model


def _is_external(t: Any) -> bool:
    import onnx

    return t.HasField("data_location") and t.data_location == onnx.TensorProto.EXTERNAL


def _check_opset(p: Path, model: Any) -> None:
    v = default_opset(model)
    if not MIN_OPSET <= v <= MAX_OPSET:
        raise OnnxImportError(
            f"{p}: default-domain opset {v} is outside what portlayer imports ({MIN_OPSET}..{MAX_OPSET}). "
            f"Re-export with opset_version between {MIN_OPSET} and {MAX_OPSET}, or convert it with "
            "onnx.version_converter.convert_version(model, 17).")
    others = sorted({o.domain for o in model.opset_import if o.domain not in ("", "ai.onnx")})
    used = {n.domain for n in model.graph.node if n.domain not in ("", "ai.onnx")}
    bad = sorted(used & set(others)) or sorted(used)
    if bad:
        raise OnnxImportError(
            f"{p}: the graph uses nodes of custom domain(s) {bad} (e.g. onnxruntime's fused contrib ops); "
            "export without graph optimisation so that only standard ONNX ops appear.")


def onnx_file_hash(path: str | Path) -> str:
    """sha256 over the .onnx file and every external-data file it names (the compile cache key)."""
    import hashlib

    import onnx

    p = Path(path)
    h = hashlib.sha256()
    files = [p]
    model = onnx.load(str(p), load_external_data=False)
    for t in model.graph.initializer:
        if _is_external(t):
            loc = next((e.value for e in t.external_data if e.key == "location"), None)
            if loc and (p.parent / loc) not in files:
                files.append(p.parent / loc)
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
