"""Per-device tuning files: launch configs measured on the real device, kept for later compiles.

A file holds, per kernel family and model shape, the config a search found fastest and its time
beside the default's. It is keyed by the descriptor's identity (name + sha256) and the toolchain
(torch, Triton): a config tuned on one GPU or compiler is a guess on another, so a file whose key
differs is refused with what it was made for. No file: the descriptor-derived defaults (the Plan
says so). The policy reads the file; nothing downstream re-decides a launch config.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from portlayer.errors import PortlayerError

FORMAT = "portlayer-tuning"
VERSION = 1
MAX_BYTES = 4 * 2**20  # a tuning file is small; a larger one is not ours


class TuningError(PortlayerError, ValueError):
    """A tuning file that is malformed or was made for another device or toolchain."""


def toolchain() -> dict[str, str]:
    """The compiler stack a tuned config holds for."""
    import importlib.metadata

    import torch

    out = {"torch": torch.__version__}
    try:
        out["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        out["triton"] = "absent"
    return out


def shape_key(req: Any, dtype: str) -> str:
    """The model dims a launch config depends on (a config tuned for one shape is only a guess for another)."""
    hd = max(getattr(req, "head_dims", None) or (0,))
    return (f"{dtype}:h{req.hidden_size}:i{getattr(req, 'intermediate_size', 0) or 0}:q{req.num_heads}"
            f":kv{req.num_kv_heads}:d{hd}")


@dataclass
class TuningFile:
    descriptor: str
    descriptor_sha256: str
    toolchain: dict[str, str]
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)  # "family@shape" -> entry
    path: Path | None = None

    def key(self, family: str, shape: str) -> str:
        return f"{family}@{shape}"

    def entry(self, family: str, shape: str) -> dict[str, Any] | None:
        return self.entries.get(self.key(family, shape))

    def put(self, family: str, shape: str, config: Mapping[str, Any], time_us: float, default_us: float,
            default: Mapping[str, Any], tried: int) -> None:
        self.entries[self.key(family, shape)] = {
            "config": dict(config), "time_us": float(time_us), "default_config": dict(default),
            "default_us": float(default_us), "candidates": int(tried),
        }  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "descriptor": self.descriptor,
                "descriptor_sha256": self.descriptor_sha256, "toolchain": self.toolchain, "entries": self.entries}

    def save(self, path: str | os.PathLike[str]) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")
        os.replace(tmp, p)
        self.path = p
        return p


def tuning_dir() -> Path:
    root = os.environ.get("PORTLAYER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "portlayer")
    return Path(root) / "tuning"


def default_path(descriptor_name: str, descriptor_sha256: str, tools: Mapping[str, str] | None = None) -> Path:
    """Where the tuning file of this (descriptor, toolchain) lives: a new toolchain starts a new file."""
    tools = dict(tools or toolchain())
    tag = hashlib.sha256(json.dumps(tools, sort_keys=True).encode()).hexdigest()[:10]
    return tuning_dir() / f"{descriptor_name}-{descriptor_sha256[:12]}-{tag}.json"


#: the largest launch parameter a tuning file may hold (a few-rows W tile of 16384 elements is a real one)
MAX_VALUE = 1 << 20


def _check(raw: Any, origin: str) -> None:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("version") != VERSION:
        raise TuningError(f"{origin}: not a portlayer tuning file (format {FORMAT!r} version {VERSION}); "
                          "delete it or re-run `portlayer tune`")
    for k, t in (("descriptor", str), ("descriptor_sha256", str), ("toolchain", dict), ("entries", dict)):
        if not isinstance(raw.get(k), t):
            raise TuningError(f"{origin}: field {k!r} missing or not a {t.__name__}; delete the file or re-run `portlayer tune`")
    for name, e in raw["entries"].items():
        ok = (isinstance(e, dict) and isinstance(e.get("config"), dict)
              and all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_VALUE for v in e["config"].values())
              and isinstance(e.get("time_us"), (int, float)) and isinstance(e.get("default_us"), (int, float)))  # fmt: skip
        if not ok:
            raise TuningError(f"{origin}: entry {name!r} is malformed (config must map names to ints in 1..{MAX_VALUE}); "
                              "delete the file or re-run `portlayer tune`")


def load_tuning(path: str | os.PathLike[str], descriptor_name: str, descriptor_sha256: str,
                tools: Mapping[str, str] | None = None) -> TuningFile:
    """Read and check a tuning file for this descriptor and toolchain; TuningError names any mismatch."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_BYTES:
            raise TuningError(f"{p}: {p.stat().st_size} bytes is not a tuning file (limit {MAX_BYTES})")
        raw = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise TuningError(f"{p}: cannot read the tuning file ({str(e)[:200]}); delete it or re-run `portlayer tune`") from None
    _check(raw, str(p))
    tools = dict(tools or toolchain())
    if raw["descriptor"] != descriptor_name or raw["descriptor_sha256"] != descriptor_sha256:
        raise TuningError(
            f"{p} was tuned for device descriptor {raw['descriptor']} (sha256 {raw['descriptor_sha256'][:12]}), "
            f"this compile targets {descriptor_name} (sha256 {descriptor_sha256[:12]}): configs measured on another "
            "device are not used; run `portlayer tune` on this device or drop the file")
    if raw["toolchain"] != tools:
        have = ", ".join(f"{k} {v}" for k, v in sorted(raw["toolchain"].items()))
        want = ", ".join(f"{k} {v}" for k, v in sorted(tools.items()))
        raise TuningError(f"{p} was tuned with {have}; this toolchain is {want}: re-run `portlayer tune` "
                          "(kernels compile differently across versions)")
    return TuningFile(raw["descriptor"], raw["descriptor_sha256"], dict(raw["toolchain"]), dict(raw["entries"]), p)


def find_tuning(descriptor_name: str, descriptor_sha256: str) -> tuple[TuningFile | None, str]:
    """The tuning file for this device (PORTLAYER_TUNING names one explicitly), and a sentence for the Plan.

    An explicit file that does not match raises; the default location holds only this key's file,
    so a mismatch there (a copied or edited file) is reported and the defaults are used."""
    explicit = os.environ.get("PORTLAYER_TUNING")
    if explicit and not Path(explicit).exists():  # named but not written yet (`portlayer tune -o` will)
        return None, f"no tuning file at PORTLAYER_TUNING={explicit}"
    if explicit:
        return load_tuning(explicit, descriptor_name, descriptor_sha256), f"tuning file {explicit}"
    p = default_path(descriptor_name, descriptor_sha256)
    if not p.is_file():
        return None, f"no tuning file for this device and toolchain ({p})"
    try:
        return load_tuning(p, descriptor_name, descriptor_sha256), f"tuning file {p}"
    except TuningError as e:
        return None, f"tuning file refused: {e}"


def apply_descriptor_defaults(decisions: list[Any], descriptor: Any) -> list[Any]:
    """``decisions`` with the parameters the descriptor's ``tuning.launch_defaults`` measured for this device
    put into launch.<family> (the reason says so and quotes the source); data, not code. A family the
    rules did not configure, or a parameter its rule does not set, is a descriptor error naming both."""
    from portlayer.capabilities.descriptor import DescriptorError
    from portlayer.capabilities.plan import Decision

    measured = (descriptor.tuning or {}).get("launch_defaults") or {}
    if not measured:
        return list(decisions)
    by_name = {d.name: d for d in decisions}
    source = descriptor.raw.get("sources", {}).get("tuning.launch_defaults", "")
    for fam, params in measured.items():
        d = by_name.get(f"launch.{fam}")
        if d is not None and d.reason.startswith("user override"):  # the user's config stands as given
            continue
        if d is None or not isinstance(d.value, dict) or not d.value:
            known = sorted(k.removeprefix("launch.") for k, v in by_name.items() if k.startswith("launch.") and v.value)
            raise DescriptorError(descriptor.origin, f"$.tuning.launch_defaults.{fam}", "kernel family",
                                  f"{fam!r} is not a kernel family this target configures (known: {', '.join(known)})")
        unknown = sorted(set(params) - set(d.value))
        if unknown:
            raise DescriptorError(descriptor.origin, f"$.tuning.launch_defaults.{fam}", "launch parameters",
                                  f"sets {unknown}, which the {fam} kernels do not take (they take {sorted(d.value)})")
        by_name[d.name] = Decision(d.name, {**d.value, **params},
                                   f"{d.reason}; measured on this device: {params} (descriptor tuning.launch_defaults"
                                   f"{': ' + source if source else ''})")
    return [by_name[d.name] for d in decisions]


def apply_tuning(decisions: list[Any], descriptor: Any, shape: str) -> list[Any]:
    """``decisions`` with each launch.<family> replaced by this device's tuned entry for ``shape``.

    A tuned config must name the same parameters as the default (the kernel's signature); the reason
    says which file and entry were used, or why the defaults stand, so the artifact's plan records it."""
    from portlayer.capabilities.plan import Decision

    tuning, why = find_tuning(descriptor.name, descriptor.sha256)
    if tuning is None and not why.startswith("tuning file refused"):
        return list(decisions)  # no file: today's defaults, reasons unchanged
    out = []
    for d in decisions:
        if not d.name.startswith("launch.") or not isinstance(d.value, dict) or not d.value or d.reason.startswith("user override"):
            out.append(d)
            continue
        fam = d.name.removeprefix("launch.")
        e = tuning.entry(fam, shape) if tuning else None
        if e is None:
            note = why if tuning is None else f"{why} has no entry {fam}@{shape}"
            out.append(Decision(d.name, d.value, f"{d.reason} (default; {note})"))
        elif set(e["config"]) != set(d.value):
            out.append(Decision(d.name, d.value, f"{d.reason} (default; tuned entry {fam}@{shape} in {tuning.path} names "
                                                 f"{sorted(e['config'])}, the kernel takes {sorted(d.value)})"))
        else:
            out.append(Decision(d.name, dict(e["config"]),
                                f"tuned: entry {fam}@{shape} of {tuning.path}: {e['time_us']:.4g} us vs the default "
                                f"{e['default_config']} at {e['default_us']:.4g} us ({e['candidates']} candidates)"))
    return out


def tuning_digest(descriptor: Any) -> str:
    """A suffix for the compile cache key: '' without a tuning file, else the file's sha256 (a new tuning
    result must not be answered by an artifact compiled with the old configs)."""
    explicit = os.environ.get("PORTLAYER_TUNING")
    p = Path(explicit) if explicit else default_path(descriptor.name, descriptor.sha256)
    try:
        return ":tuning-" + hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
    except OSError:
        return ""
