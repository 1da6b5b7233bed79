"""Capability descriptors: load, validate and view the JSON that says what a device can do.

Descriptors are data so a user can add or edit one without touching code. Validation is
strict and every error names the file, the JSON path and the rule broken, because a
silently wrong number here skews every decision the policy makes downstream.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from portlayer.capabilities.plugins import BUILTIN_CODEGEN, codegen_families, plugin_descriptors
from portlayer.errors import PortlayerError

HERE = Path(__file__).resolve().parent
SCHEMA_PATH = HERE / "schema.json"
DEVICES_DIR = HERE / "devices"
SCHEMA_VERSION = 1

# Generic feature flags the passes key on; vendor call names live in ``vendor_ops``.
KNOWN_FEATURES = frozenset(
    {
        "tensor_cores", "matrix_cores", "xmx", "cube_unit", "fp8", "tma", "wgmma", "graph_capture",
        "async_copy", "cooperative_launch", "programmatic_dependent_launch", "unified_memory", "avx2", "avx512",
        "avx512_bf16", "amx",
        "fused_add_rms_norm", "fused_rms_norm", "fused_rope", "fused_swiglu", "paged_attention",
        "fused_reshape_and_cache", "weight_quant_matmul", "flash_attention", "nz_weight_format",
    }
)  # fmt: skip

# Accept both short and torch dtype names when asking for throughput.
DTYPE_KEYS = {
    "float64": "fp64", "float32": "fp32", "tfloat32": "tf32", "bfloat16": "bf16", "float16": "fp16",
    "float8": "fp8", "float8_e4m3fn": "fp8", "int8": "int8", "int4": "int4",
}  # fmt: skip


class DescriptorError(PortlayerError, ValueError):
    """A descriptor broke a rule; carries the file, the JSON path and the rule for tooling."""

    def __init__(self, origin: str, path: str, rule: str, detail: str) -> None:
        self.origin, self.path, self.rule, self.detail = origin, path, rule, detail
        super().__init__(
            f"{origin}: {path}: {rule}: {detail}. Fix the descriptor (see capabilities/schema.json "
            "and docs/capabilities.md) or start from a shipped one: `portlayer devices --json`."
        )


@functools.cache
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def _json_path(parts: Iterator[Any]) -> str:
    out = "$"
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _schema_error(origin: str, err: Any) -> DescriptorError:
    path = _json_path(iter(err.absolute_path))
    rule, detail = err.validator, err.message
    if rule == "required":
        m = re.match(r"'(.+)' is a required property", err.message)
        if m:
            path = f"{path}.{m.group(1)}"
            detail = "field is missing"
    elif rule == "additionalProperties":
        m = re.search(r"\('(.+?)' (?:was|were) unexpected\)", err.message)
        if m:
            path = f"{path}.{m.group(1)}"
            detail = "unknown field (typo?)"
    elif rule == "const" and path == "$.schema_version":
        detail = f"{err.instance!r} is not supported; this portlayer reads schema_version {SCHEMA_VERSION}"
    else:
        detail = f"{err.message} (rule {rule}={err.validator_value!r})" if rule not in ("type",) else err.message
    return DescriptorError(origin, path, rule, detail)


def _numeric_leaves(obj: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _numeric_leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield prefix


def _covered(path: str, sources: Mapping[str, str]) -> bool:
    parts = path.split(".")
    return any(".".join(parts[:i]) in sources for i in range(len(parts), 0, -1))


MAX_DEPTH = 32  # shipped descriptors nest 3 deep; anything far deeper is not a descriptor


def _check_plain_data(raw: Any, origin: str) -> None:
    """Finite numbers and bounded nesting, before any recursive validator sees the data.

    JSON readers accept NaN and Infinity, and both pass ``exclusiveMinimum: 0`` checks
    (NaN compares false), so they would reach the policy as throughput; a 100k-deep
    document would make the schema validator recurse out of the stack.
    """
    stack: list[tuple[Any, tuple[Any, ...]]] = [(raw, ())]
    while stack:
        node, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise DescriptorError(origin, _json_path(iter(path[:MAX_DEPTH])), "max_depth",
                                  f"nests deeper than {MAX_DEPTH} levels; a descriptor is a shallow JSON object")
        if isinstance(node, float) and not math.isfinite(node):
            raise DescriptorError(origin, _json_path(iter(path)), "finite",
                                  f"{node!r} is not a finite number; give the measured or datasheet value")
        if isinstance(node, Mapping):
            stack.extend((v, (*path, k)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(node))


def validate(raw: Mapping[str, Any], origin: str = "<dict>") -> None:
    """Raise DescriptorError for the first broken rule: plain data, schema, then cross-field rules."""
    _check_plain_data(raw, origin)
    errors = sorted(_iter_schema_errors(raw), key=lambda e: (len(e.absolute_path), list(map(str, e.path))))
    if errors:
        raise _schema_error(origin, errors[0])
    _semantic_checks(raw, origin)


def _iter_schema_errors(raw: Mapping[str, Any]) -> Iterator[Any]:
    """jsonschema when installed; the built-in subset validator otherwise (e.g. on GPU hosts)."""
    try:
        import jsonschema
    except ImportError:
        from portlayer.capabilities.minischema import iter_errors

        return iter_errors(schema(), raw)
    return jsonschema.Draft202012Validator(schema()).iter_errors(raw)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _semantic_checks(raw: Mapping[str, Any], origin: str) -> None:
    """Rules JSON Schema cannot state: powers of two, cross references, source coverage."""
    if not _pow2(raw["warp_size"]):
        raise DescriptorError(origin, "$.warp_size", "power_of_two", f"{raw['warp_size']} is not a power of two")
    if "warp_sizes" in raw and raw["warp_size"] not in raw["warp_sizes"]:
        raise DescriptorError(origin, "$.warp_size", "member_of_warp_sizes", f"{raw['warp_size']} not in {raw['warp_sizes']}")
    align = raw["memory"]["alignment_bytes"]
    if not _pow2(align):
        raise DescriptorError(origin, "$.memory.alignment_bytes", "power_of_two", f"{align} is not a power of two")
    cu = raw["compute_units"]
    if cu.get("max_shared_memory_per_block_bytes", 0) > cu["shared_memory_per_unit_bytes"]:
        raise DescriptorError(
            origin, "$.compute_units.max_shared_memory_per_block_bytes", "le_shared_memory_per_unit",
            "a block cannot use more shared memory than its unit has",
        )  # fmt: skip
    for i, bs in enumerate(raw.get("kv_cache", {}).get("block_sizes", [])):
        if not _pow2(bs):
            raise DescriptorError(origin, f"$.kv_cache.block_sizes[{i}]", "power_of_two", f"{bs} is not a power of two")
    features = set(raw["features"])
    for feat in raw.get("vendor_ops", {}):
        if feat not in features:
            raise DescriptorError(
                origin, f"$.vendor_ops.{feat}", "listed_in_features", f"'{feat}' has a vendor op but is not in $.features"
            )
    if raw["codegen"] not in BUILTIN_CODEGEN and raw["codegen"] not in codegen_families():
        raise DescriptorError(
            origin, "$.codegen", "known_codegen_family",
            f"{raw['codegen']!r} is not a codegen family here (have: {', '.join(sorted(codegen_families()))}); "
            "use one of them, or install the backend plugin that declares it",
        )  # fmt: skip
    if raw["device_type"] != "cpu" and raw["codegen"] == "torch" and "graph_capture" in features:
        raise DescriptorError(origin, "$.features", "consistent_codegen", "torch codegen cannot graph-capture")
    sources = raw["sources"]
    for key in sources:
        if not _field_exists(key, raw):
            raise DescriptorError(origin, f"$.sources.{key}", "names_a_field", f"'{key}' is not a field of this descriptor")
    for leaf in _numeric_leaves({k: v for k, v in raw.items() if k not in ("schema_version", "calibration")}):
        if not _covered(leaf, sources):
            raise DescriptorError(
                origin, f"$.{leaf}", "has_source", f"no entry in $.sources says where this number came from (add '{leaf}')"
            )


def _field_exists(path: str, raw: Mapping[str, Any]) -> bool:
    node: Any = raw
    for p in path.split("."):
        if not isinstance(node, Mapping) or p not in node:
            return False
        node = node[p]
    return True


@dataclass(frozen=True)
class ComputeUnits:
    count: int
    kind: str
    max_threads_per_unit: int
    shared_memory_per_unit_bytes: int
    registers_per_unit: int
    max_shared_memory_per_block_bytes: int
    clock_mhz: float | None


@dataclass(frozen=True)
class Memory:
    capacity_gb: float
    bandwidth_gbps: float
    alignment_bytes: int
    managed: bool
    unified_with_host: bool

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_gb * 1e9)


@dataclass(frozen=True)
class Descriptor:
    """Read-only view of a validated descriptor; ``raw`` returns a copy of the JSON."""

    name: str
    display_name: str
    device_type: str
    vendor: str
    arch: str
    codegen: str
    warp_size: int
    compute_units: ComputeUnits
    throughput: Mapping[str, float]
    memory: Memory
    dma_engines: int
    dma_max_concurrent_transfers: int
    memory_fence_scope: str
    features: frozenset[str]
    vendor_ops: Mapping[str, str]
    preferred_dtypes: tuple[str, ...]
    kv_block_sizes: tuple[int, ...]
    kv_cache_dtypes: tuple[str, ...]
    max_head_dim: int | None
    origin: str
    sha256: str
    _raw_json: str

    @property
    def raw(self) -> dict[str, Any]:
        return json.loads(self._raw_json)

    @property
    def tuning(self) -> dict[str, Any]:
        """Measured crossovers codegen follows ($.tuning; each number has its entry in sources)."""
        return dict(self.raw.get("tuning", {}))

    def has(self, feature: str) -> bool:
        return feature in self.features

    def tflops(self, dtype: str) -> float | None:
        """Dense throughput for a dtype ('bf16' or 'bfloat16'); None means unsupported."""
        return self.throughput.get(DTYPE_KEYS.get(dtype, dtype))

    def source(self, path: str) -> str:
        """Where the number at a dotted path came from (nearest parent entry in ``sources``)."""
        sources = self.raw["sources"]
        parts = path.removeprefix("$.").split(".")
        for i in range(len(parts), 0, -1):
            key = ".".join(parts[:i])
            if key in sources:
                return sources[key]
        return "no source given"

    def __repr__(self) -> str:
        return f"Descriptor({self.name!r}, {self.device_type}, {self.arch}, from {self.origin})"

    @staticmethod
    def from_dict(raw: Mapping[str, Any], origin: str = "<dict>") -> Descriptor:
        validate(raw, origin)
        canonical = json.dumps(raw, sort_keys=True, separators=(",", ":"))
        cu, mem = raw["compute_units"], raw["memory"]
        return Descriptor(
            name=raw["name"],
            display_name=raw.get("display_name", raw["name"]),
            device_type=raw["device_type"],
            vendor=raw["vendor"],
            arch=raw["arch"],
            codegen=raw["codegen"],
            warp_size=raw["warp_size"],
            compute_units=ComputeUnits(
                count=cu["count"],
                kind=cu["kind"],
                max_threads_per_unit=cu["max_threads_per_unit"],
                shared_memory_per_unit_bytes=cu["shared_memory_per_unit_bytes"],
                registers_per_unit=cu["registers_per_unit"],
                max_shared_memory_per_block_bytes=cu.get(
                    "max_shared_memory_per_block_bytes", cu["shared_memory_per_unit_bytes"]
                ),
                clock_mhz=cu.get("clock_mhz"),
            ),
            throughput=MappingProxyType({k: float(v) for k, v in raw["throughput_tflops"].items()}),
            memory=Memory(
                capacity_gb=float(mem["capacity_gb"]),
                bandwidth_gbps=float(mem["bandwidth_gbps"]),
                alignment_bytes=mem["alignment_bytes"],
                managed=mem["managed"],
                unified_with_host=mem["unified_with_host"],
            ),
            dma_engines=raw["dma"]["engines"],
            dma_max_concurrent_transfers=raw["dma"]["max_concurrent_transfers"],
            memory_fence_scope=raw["memory_fence_scope"],
            features=frozenset(raw["features"]),
            vendor_ops=MappingProxyType(dict(raw.get("vendor_ops", {}))),
            preferred_dtypes=tuple(raw.get("preferred_dtypes", ())),
            kv_block_sizes=tuple(raw.get("kv_cache", {}).get("block_sizes", ())),
            kv_cache_dtypes=tuple(raw.get("kv_cache", {}).get("dtypes", ())),
            max_head_dim=raw.get("kv_cache", {}).get("max_head_dim"),
            origin=origin,
            sha256=hashlib.sha256(canonical.encode()).hexdigest(),
            _raw_json=canonical,
        )


def list_descriptors() -> list[str]:
    """Names of the shipped descriptors (file stems under capabilities/devices/)."""
    return sorted(p.stem for p in DEVICES_DIR.glob("*.json"))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DescriptorError(str(path), "$", "file_exists", "no such file") from None
    except json.JSONDecodeError as e:
        raise DescriptorError(str(path), "$", "valid_json", f"line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise DescriptorError(str(path), "$", "max_depth",
                              f"nests too deeply to read; a descriptor is a shallow JSON object ({MAX_DEPTH} levels at most)") from None
    except UnicodeDecodeError as e:
        raise DescriptorError(str(path), "$", "valid_json", f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(data, dict):
        raise DescriptorError(str(path), "$", "type", f"top level must be an object, got {type(data).__name__}")
    return data


def load_descriptor(name_or_path: str | Path) -> Descriptor:
    """A shipped descriptor by name ('nvidia-h200') or any descriptor JSON file by path."""
    if isinstance(name_or_path, Descriptor):
        return name_or_path
    text = str(name_or_path)
    path = Path(text)
    if path.suffix == ".json" or path.exists() or "/" in text:
        return _load_file(path.resolve())
    shipped = DEVICES_DIR / f"{text}.json"
    if shipped.exists():
        return _load_file(shipped)
    from_plugins = plugin_descriptors()
    if text in from_plugins:
        return _load_file(from_plugins[text])
    extra = f"; from plugins: {', '.join(sorted(from_plugins))}" if from_plugins else ""
    raise DescriptorError(
        text, "$", "known_descriptor",
        f"no shipped descriptor named {text!r}; shipped: {', '.join(list_descriptors())}{extra}; "
        "or pass a path to a descriptor .json",
    )  # fmt: skip


def _load_file(path: Path) -> Descriptor:
    return Descriptor.from_dict(_read_json(path), origin=str(path))


def deep_merge(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``patch`` merged in recursively (dicts merge, everything else replaces)."""
    out = copy.deepcopy(dict(base))
    for k, v in patch.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else copy.deepcopy(v)
    return out
