"""Run the torch-npu wheel's own meta (shape) functions on the CPU, in a child process.

Why a child process: the wheel's ``_meta_registrations.py`` registers kernels into a torch.library
namespace ``npu`` and imports ``torch_npu`` (which cannot load here); doing that in a throwaway
interpreter keeps the caller's torch clean. The wheel is never installed: the schemas are defined
from its YAML through ``torch.library``, the ``torch_npu`` imports the file makes are stubbed, and
only the meta functions of the ops asked about are registered.

This module is the one place where code from the wheel runs (tests only, on a wheel pip fetched
from PyPI with hash checking); portlayer's runtime never does.

Protocol: ``python -m portlayer.backends.ascend_wheel_meta WHEEL`` reads JSON
``[{"name", "args", "kwargs"}]`` on stdin (tensors as ``{"tensor": shape, "dtype": name}``) and
writes JSON ``[{"ok": bool, "result" | "error"}]`` on stdout.
"""

from __future__ import annotations

import enum
import json
import re
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

from portlayer.backends.ascend_schemas import META_PATH, YAML_PATH, schema_strings

STUBBED = ("torch_npu", "torch_npu.utils", "torch_npu.utils._error_code", "torch_npu.npu", "torch_npu.npu.utils",
           "torch_npu.npu._backends")


class _Stub(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: None


class _ErrCode(enum.Enum):
    PARAM = "PARAM"
    VALUE = "VALUE"
    TYPE = "TYPE"
    NOT_SUPPORT = "NOT_SUPPORT"
    INTERNAL = "INTERNAL"
    UNAVAIL = "UNAVAIL"


def install_meta(wheel: Path, names: set[str]) -> None:
    """Define the schemas of ``names`` under torch.ops.npu and register the wheel's meta functions for them."""
    import torch
    import torch.library
    import yaml

    for m in STUBBED:
        sys.modules[m] = _Stub(m)
    sys.modules["torch_npu.utils._error_code"].ErrCode = _ErrCode  # type: ignore[attr-defined]
    sys.modules["torch_npu.utils._error_code"].ops_error = lambda *a, **k: ""  # type: ignore[attr-defined]
    with zipfile.ZipFile(wheel) as z:
        funcs = schema_strings(yaml.load(z.read(YAML_PATH), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
        src = z.read(META_PATH).decode()
    lib = torch.library.Library("npu", "DEF")
    referenced = set(re.findall(r"torch\.ops\.npu\.(\w+)", src))  # module-level uses (has_side_effect(...))
    for f in dict.fromkeys(funcs):  # the YAML lists some schemas twice
        if re.split(r"[.(]", f, maxsplit=1)[0] in names | referenced:
            lib.define(f)
    real_impl = torch.library.impl

    def only_wanted(lib_: Any, name: str, *a: Any, **k: Any) -> Any:
        base = name.split(".")[0]
        if isinstance(lib_, torch.library.Library) and lib_.ns == "npu" and base in names:
            return real_impl(lib_, name, *a, **k)
        return lambda fn: fn

    torch.library.impl = only_wanted  # type: ignore[assignment]
    try:
        exec(compile(src, f"{wheel.name}:{META_PATH}", "exec"), {"__name__": "torch_npu_meta_from_wheel"})  # noqa: S102
    finally:
        torch.library.impl = real_impl  # type: ignore[assignment]
    install_meta.lib = lib  # type: ignore[attr-defined]  # keep the definitions alive


def encode(v: Any) -> Any:
    """JSON form of a call's value: tensors as {"tensor": shape, "dtype": name}."""
    import torch

    if isinstance(v, torch.Tensor):
        return {"tensor": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
    if isinstance(v, (list, tuple)):
        return [encode(x) for x in v]
    return v


def decode(v: Any) -> Any:
    """Inverse of :func:`encode`, tensors rebuilt on the meta device (no storage)."""
    import torch

    if isinstance(v, dict) and set(v) == {"tensor", "dtype"}:
        return torch.empty(v["tensor"], dtype=getattr(torch, v["dtype"]), device="meta")
    if isinstance(v, dict):
        return {k: decode(x) for k, x in v.items()}
    if isinstance(v, list):
        return [decode(x) for x in v]
    return v


def main() -> int:
    import torch

    wheel = Path(sys.argv[1])
    calls = json.load(sys.stdin)
    install_meta(wheel, {c["name"] for c in calls})
    out = []
    for c in calls:
        try:
            fn = getattr(torch.ops.npu, c["name"])
            res = fn(*decode(c["args"]), **decode(c["kwargs"]))
            out.append({"ok": True, "result": encode(res)})
        except Exception as e:  # noqa: BLE001 - reported to the parent per call
            out.append({"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
