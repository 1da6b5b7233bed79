"""Check the torch_npu calls portlayer makes against the wheel's schemas (backends/ascend_schemas.py).

Three views of one question, "would the real torch_npu accept this call?":
- :func:`calls_in_source`: every ``npu.X(...)`` call in a generated CANN program, read with ``ast``
  (all branches, also those a test run does not reach), with literal arguments' values;
- :class:`RecordingNpu`: wraps the emulator and records each call's real argument values at run time;
- :func:`signature_problems`: the emulator's own method signatures (names, order, keyword-only
  markers, defaults) against the schemas.
:func:`call_problems` binds one call to the schema the way torch's argument parser does and names
every disagreement (unknown op, unknown keyword, too many positionals, a keyword-only argument
passed by position, a missing required argument, a value of the wrong kind).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from portlayer.backends.ascend_schemas import OpSchema, Param, WheelSchemas


class Unknown:
    """An argument whose value the source does not show (a variable)."""

    def __repr__(self) -> str:
        return "<expr>"


UNKNOWN = Unknown()


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument seen at run time, kept as shape and dtype only (no storage is retained)."""

    shape: tuple[int, ...]
    dtype: str

    def __repr__(self) -> str:
        return f"Tensor({self.dtype}, {list(self.shape)})"


@dataclass
class Call:
    name: str
    args: list[Any]
    kwargs: dict[str, Any]
    where: str = ""
    result: Any = None  # run time: the result with tensors as TensorSpec


# ---- binding ----------------------------------------------------------------------------------------------


def _kind_ok(p: Param, v: Any) -> bool:
    if isinstance(v, Unknown):
        return True
    if v is None:
        return p.optional or p.default == "None"
    k = p.kind
    if k == "Tensor":
        return isinstance(v, (torch.Tensor, TensorSpec))
    if k in ("int", "SymInt"):
        return isinstance(v, int) and not isinstance(v, bool)
    if k == "float":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if k == "bool":
        return isinstance(v, bool)
    if k == "str":
        return isinstance(v, str)
    if k.endswith("[]") and k[:-2] in ("int", "SymInt"):
        return isinstance(v, (list, tuple)) and all(isinstance(x, (int, Unknown)) and not isinstance(x, bool) for x in v)
    if k == "Tensor[]":
        return isinstance(v, (list, tuple)) and all(isinstance(x, (torch.Tensor, TensorSpec, Unknown)) for x in v)
    return True  # a kind this checker does not model (ScalarType, Layout, ...): not judged


def _kind(v: Any) -> str:
    if isinstance(v, (torch.Tensor, TensorSpec)):
        return repr(spec(v))
    return f"{type(v).__name__} {v!r}"


def bind_problems(op: OpSchema, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[str]:
    """Why torch would reject ``op(*args, **kwargs)`` (empty: it binds)."""
    out = []
    pos = op.positional
    if len(args) > len(pos):
        kw = [p.name for p in op.params if p.kw_only]
        out.append(f"{len(args)} positional arguments, the schema takes {len(pos)}"
                   + (f" (keyword-only: {', '.join(kw[:len(args) - len(pos)])}...)" if kw else ""))
    bound: dict[str, Any] = {p.name: v for p, v in zip(pos, args)}
    for k, v in kwargs.items():
        p = op.param(k)
        if p is None:
            out.append(f"unknown argument {k}= (schema: {', '.join(x.name for x in op.params)})")
        elif k in bound:
            out.append(f"{k} given by position and by keyword")
        else:
            bound[k] = v
    for p in op.params:
        if p.name not in bound:
            if p.required:
                out.append(f"required argument {p.name} ({p.kind}) is missing")
        elif not _kind_ok(p, bound[p.name]):
            out.append(f"{p.name} expects {p.kind}{'?' if p.optional else ''}, got {_kind(bound[p.name])}")
    return out


def call_problems(schemas: WheelSchemas, call: Call) -> list[str]:
    """[] when some overload of the wheel's op accepts ``call``; else the closest overload's problems."""
    ops = schemas.overloads(call.name)
    if not ops:
        return [f"{call.name} is not an op of torch_npu {schemas.version} ({call.where})"]
    tries = [bind_problems(op, call.args, call.kwargs) for op in ops]
    best = min(tries, key=len)
    return [] if not best else [f"{call.name} ({call.where}): {p}" for p in best]


# ---- calls in generated source ---------------------------------------------------------------------------


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        if isinstance(node, (ast.List, ast.Tuple)):
            return [_literal(e) for e in node.elts]
        return UNKNOWN


def calls_in_source(source: str, module: str = "npu", where: str = "") -> list[Call]:
    """Every ``npu.NAME(...)`` call in ``source`` (also ``self.npu.NAME``), with literal values."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        base = node.func.value
        is_npu = (isinstance(base, ast.Name) and base.id == module) or (
            isinstance(base, ast.Attribute) and base.attr == module)
        if not is_npu:
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            out.append(Call(node.func.attr, [UNKNOWN], {}, f"{where}:{node.lineno} (*args/**kwargs: not checkable)"))
            continue
        out.append(Call(node.func.attr, [_literal(a) for a in node.args],
                        {k.arg: _literal(k.value) for k in node.keywords if k.arg}, f"{where}:{node.lineno}"))
    return out


# ---- calls at run time -----------------------------------------------------------------------------------


def spec(v: Any) -> Any:
    """``v`` with every tensor replaced by its TensorSpec."""
    if isinstance(v, torch.Tensor):
        return TensorSpec(tuple(v.shape), str(v.dtype).removeprefix("torch."))
    if isinstance(v, (list, tuple)):
        return type(v)(spec(x) for x in v)
    return v


class RecordingNpu:
    """Stands in for ``npu``: forwards each call to ``inner`` (the emulator) and records it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.recorded: list[Call] = []

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._inner, name)
        if not callable(target) or name.startswith("__"):
            return target

        def record(*args: Any, **kwargs: Any) -> Any:
            c = Call(name, [spec(a) for a in args], {k: spec(v) for k, v in kwargs.items()}, "run time")
            result = target(*args, **kwargs)
            c.result = spec(result)
            self.recorded.append(c)
            return result

        return record


# ---- the emulator's signatures ---------------------------------------------------------------------------


def signature_problems(schemas: WheelSchemas, name: str, fn: Any) -> list[str]:
    """Where the emulator method ``fn`` differs from the wheel's schema of ``name``: names, order,
    keyword-only markers and (where the schema states them) defaults."""
    ops = [o for o in schemas.overloads(name) if not any(p.written and p.kw_only for p in o.params)] or \
        schemas.overloads(name)
    if not ops:
        return [f"{name}: no such op in torch_npu {schemas.version}"]
    op = ops[0]
    allp = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    catch_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in allp)
    sig = [p for p in allp if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
    names = ["self" if p.name == "self_" else p.name for p in sig]
    out = []
    want = [p.name for p in op.params]
    if catch_all:  # named parameters: an ordered subset; the rest are taken (and refused) by **kwargs
        it = iter(want)
        if not all(n in it for n in names):
            return [f"{name}: parameters {names} are not in the schema's order {want}"]
        omitted = [q for q in op.params if q.name not in names]
        out += [f"{name}: {q.name} is positional in the schema but only **kwargs takes it" for q in omitted
                if not q.kw_only]
        pairs = [(p, op.param(n)) for p, n in zip(sig, names)]
    elif names != want:
        return [f"{name}: parameters {names}, schema {want}"]
    else:
        pairs = list(zip(sig, op.params))
    for p, q in pairs:
        if op.defaults_known and (p.kind is inspect.Parameter.KEYWORD_ONLY) != q.kw_only:
            out.append(f"{name}: {q.name} is {'keyword-only' if q.kw_only else 'positional'} in the schema")
        has = p.default is not inspect.Parameter.empty
        if op.defaults_known and has != (q.default is not None):
            out.append(f"{name}: {q.name} {'has' if has else 'lacks'} a default; schema: {q.default}")
        elif op.defaults_known and has and p.default != q.default_value():
            out.append(f"{name}: {q.name} defaults to {p.default!r}, schema {q.default}")
    return out


# ---- the wheel's meta functions ---------------------------------------------------------------------------


def to_json(v: Any) -> Any:
    if isinstance(v, TensorSpec):
        return {"tensor": list(v.shape), "dtype": v.dtype}
    if isinstance(v, torch.Tensor):
        return to_json(spec(v))
    if isinstance(v, (list, tuple)):
        return [to_json(x) for x in v]
    if isinstance(v, dict):
        return {k: to_json(x) for k, x in v.items()}
    return v


def meta_ops(schemas: WheelSchemas) -> set[str]:
    """The op names the wheel's ``_meta_registrations.py`` gives a meta (shape) function."""
    import re
    import zipfile

    from portlayer.backends.ascend_schemas import META_PATH

    with zipfile.ZipFile(schemas.wheel) as z:
        src = z.read(META_PATH).decode()
    return {m.split(".")[0] for m in re.findall(r'@impl\(m, "([\w.]+)"\)', src)}


def wheel_meta(wheel: Any, calls: Sequence[Call], timeout: float = 300) -> list[dict[str, Any]]:
    """Each call run through the wheel's meta function (in a child process, see ascend_wheel_meta)."""
    import json
    import subprocess
    import sys

    payload = json.dumps([{"name": c.name, "args": to_json(c.args), "kwargs": to_json(c.kwargs)} for c in calls])
    r = subprocess.run([sys.executable, "-m", "portlayer.backends.ascend_wheel_meta", str(wheel)], input=payload,
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"the wheel's meta functions did not run (rc {r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout)
