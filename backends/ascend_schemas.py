"""The authoritative torch_npu op schemas, read from the torch-npu wheel WITHOUT installing it.

Why: the CANN program (codegen/cann.py) and the CPU emulator (backends/ascend_emulator.py) were
written from documentation (../shared/reference/ascend-ops.md). The torch-npu wheel on PyPI
carries the schemas the real library registers, so a call can be checked against them on any
machine: installing the wheel would replace torch (and ``import torch_npu`` needs CANN), so the
wheel is only opened as a zip.

Sources inside the wheel:
- ``npu_native_functions_by_codegen.yaml``: ``func:`` schema strings (``npu_rms_norm``, ``npu_mrope``,
  ``npu_fused_infer_attention_score`` ...), parsed by torchgen's FunctionSchema parser;
- ``AtbOpsInterface.h``: the C++ declarations generated from the ATB op schemas (``_npu_paged_attention``,
  ``_npu_reshape_and_cache``, ``_npu_rotary_embedding``); they give names, order, kinds and which
  tensors are written, but neither defaults nor keyword-only markers (the schema strings themselves
  are compiled into libop_plugin_atb.so and not recoverable as text).

Nothing from the wheel is imported or evaluated here: YAML goes through ``yaml.safe_load``, the
header through a regular expression, defaults through ``ast.literal_eval``.
"""

from __future__ import annotations

import ast
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from portlayer.config import cache_root

WHEEL_NAME, WHEEL_VERSION = "torch-npu", "2.14.0"
YAML_PATH = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
ATB_HEADER = "torch_npu/include/third_party/op-plugin/op_plugin/include/AtbOpsInterface.h"
META_PATH = "torch_npu/op_plugin/meta/_meta_registrations.py"
ATB_META_PATH = "torch_npu/op_plugin/atb/_atb_meta_registrations.py"
VERSION_PATH = "torch_npu/version.py"


class WheelUnavailable(RuntimeError):
    """The torch-npu wheel could not be obtained (no network, no pip); the message says why."""


@dataclass(frozen=True)
class Param:
    """One schema argument. ``kind`` is the schema type without ``?`` (Tensor, int, float, bool, str,
    int[], SymInt[], ...); ``default`` is the schema's default text or None when it has none."""

    name: str
    kind: str
    optional: bool
    kw_only: bool
    default: str | None
    written: bool = False

    @property
    def required(self) -> bool:
        return self.default is None

    def default_value(self) -> object:
        """The default as a Python value (schema literals: numbers, quoted strings, True/False/None)."""
        if self.default is None:
            raise ValueError(f"{self.name} has no default")
        text = {"true": "True", "false": "False"}.get(self.default, self.default)
        return ast.literal_eval(text)


@dataclass(frozen=True)
class OpSchema:
    name: str
    params: tuple[Param, ...]
    returns: str
    source: str  # the file inside the wheel
    defaults_known: bool = True  # False for ATB ops (header only)

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def positional(self) -> list[Param]:
        return [p for p in self.params if not p.kw_only]


@dataclass
class WheelSchemas:
    wheel: Path
    version: str
    git_version: str
    sha256: str
    ops: dict[str, list[OpSchema]] = field(default_factory=dict)  # base name -> overloads
    unparsed: list[str] = field(default_factory=list)

    def overloads(self, name: str) -> list[OpSchema]:
        return self.ops.get(name, [])


# ---- obtaining the wheel ------------------------------------------------------------------------------


def wheel_dir() -> Path:
    return cache_root() / "wheels" / f"{WHEEL_NAME}-{WHEEL_VERSION}"


def obtain_wheel(directory: Path | None = None, timeout: float = 600) -> Path:
    """The cached wheel, downloaded once (``pip download --no-deps``) into ``directory`` (default: the
    portlayer cache). Raises WheelUnavailable with pip's reason when it cannot be fetched."""
    d = directory or wheel_dir()
    found = sorted(d.glob("torch_npu-*.whl")) if d.is_dir() else []
    if found:
        return found[0]
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".dl-", dir=d.parent))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               f"{WHEEL_NAME}=={WHEEL_VERSION}", "--only-binary=:all:", "-d", str(tmp)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise WheelUnavailable(f"`{' '.join(cmd[2:])}` did not run: {e}") from None
        got = sorted(tmp.glob("torch_npu-*.whl"))
        if r.returncode or not got:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            raise WheelUnavailable(f"`pip download {WHEEL_NAME}=={WHEEL_VERSION}` failed (rc {r.returncode}): "
                                   + " | ".join(tail))
        try:
            tmp.rename(d)  # atomic: a concurrent process either sees the whole directory or none
        except OSError:
            if not sorted(d.glob("torch_npu-*.whl")):
                raise
        return sorted(d.glob("torch_npu-*.whl"))[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- parsing ----------------------------------------------------------------------------------------------


def schema_strings(node: object) -> list[str]:
    """Every ``func:`` string in the parsed YAML, in file order."""
    if isinstance(node, dict):
        out = [node["func"]] if isinstance(node.get("func"), str) else []
        for k, v in node.items():
            if k != "func":
                out += schema_strings(v)
        return out
    if isinstance(node, list):
        return [f for x in node for f in schema_strings(x)]
    return []


def parse_schema(text: str, source: str) -> tuple[str, OpSchema]:
    """(overload-qualified name, OpSchema) of one torch schema string, through torchgen's parser."""
    from torchgen.model import FunctionSchema

    s = FunctionSchema.parse(text)
    kw = {a.name for a in s.arguments.flat_kwarg_only} | {a.name for a in s.arguments.out}
    params = []
    for a in s.arguments.flat_all:
        t = str(a.type)
        opt = t.endswith("?")
        params.append(Param(a.name, t.rstrip("?"), opt, a.name in kw, a.default,
                            bool(a.annotation is not None and a.annotation.is_write)))
    base = str(s.name.name)
    full = f"{base}.{s.name.overload_name}" if s.name.overload_name else base
    return full, OpSchema(base, tuple(params), ", ".join(str(r) for r in s.returns), source)


_CPP_KIND = [
    (re.compile(r"^const\s+at::Tensor\s*&$"), "Tensor", False, False),
    (re.compile(r"^at::Tensor\s*&$"), "Tensor", False, True),
    (re.compile(r"^const\s+c10::optional<at::Tensor>\s*&$"), "Tensor", True, False),
    (re.compile(r"^(const\s+)?int64_t$"), "int", False, False),
    (re.compile(r"^(const\s+)?double$"), "float", False, False),
    (re.compile(r"^(const\s+)?bool$"), "bool", False, False),
    (re.compile(r"^c10::SymIntArrayRef$"), "SymInt[]", False, False),
    (re.compile(r"^c10::OptionalArrayRef<c10::SymInt>$"), "SymInt[]", True, False),
    (re.compile(r"^c10::optional<c10::string_view>$"), "str", True, False),
]
_DECL = re.compile(r"TORCH_NPU_API\s+(?P<ret>.+?)\s+(?P<name>\w+)\((?P<args>[^)]*)\);")


def parse_atb_header(text: str, source: str) -> dict[str, OpSchema]:
    """The ATB ops of AtbOpsInterface.h as OpSchemas (no defaults, no keyword-only markers: the
    header does not carry them). ``_out`` variants are skipped (the Python API is the functional one)."""
    ops: dict[str, OpSchema] = {}
    for m in _DECL.finditer(text):
        params = []
        for raw in (x.strip() for x in m["args"].split(",") if x.strip()):
            typ, name = raw.replace("&", "& ").rsplit(None, 1)
            typ = " ".join(typ.split()).replace(" &", "&")
            for pat, kind, opt, written in _CPP_KIND:
                if pat.match(typ):
                    # assumption (unconfirmed, the header has no defaults): an optional argument defaults to None
                    params.append(Param(name.removesuffix("_opt") if opt and kind == "str" else name, kind, opt,
                                        False, "None" if opt else None, written))
                    break
            else:
                params.append(Param(name, f"<{typ}>", False, False, None, False))
        ops[m["name"]] = OpSchema(m["name"], tuple(params), m["ret"], source, defaults_known=False)
    return ops


def load_schemas(wheel: Path, names: set[str] | None = None) -> WheelSchemas:
    """The op schemas in the wheel (YAML through torchgen, ATB ops through the header); ``names``
    limits the (slow) torchgen parse to those base names."""
    with zipfile.ZipFile(wheel) as z:
        text = z.read(YAML_PATH).decode()
        header = z.read(ATB_HEADER).decode()
        version_src = z.read(VERSION_PATH).decode()
    version = re.search(r"__version__\s*=\s*'([^']+)'", version_src)
    git = re.search(r"git_version\s*=\s*'([^']+)'", version_src)
    out = WheelSchemas(wheel, version[1] if version else "?", git[1] if git else "?",
                       hashlib.sha256(wheel.read_bytes()).hexdigest())
    for f in schema_strings(yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))):
        if names is not None and re.split(r"[.(]", f, maxsplit=1)[0] not in names:
            continue
        try:
            full, op = parse_schema(f, YAML_PATH)
        except Exception as e:  # noqa: BLE001 - a schema torchgen cannot read is reported, not fatal
            out.unparsed.append(f"{f[:80]}: {e}")
            continue
        if op not in out.ops.setdefault(op.name, []):
            out.ops[op.name].append(op)
    for name, op in parse_atb_header(header, ATB_HEADER).items():
        if names is None or name in names:
            out.ops.setdefault(name, []).append(op)
    return out
