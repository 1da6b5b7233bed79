"""Host and device memory that compiling and serving a model need, known before anything is loaded.

Compile holds the checkpoint's weights once, at their stored dtype (weights flow to the
artifact tensor by tensor: flatten/weights_stream.py), plus the toolkit itself and a few
tensors in flight; a lossy format adds its quantized weights, held beside the originals while
the quality gate compares the two graphs. Serving maps the artifact's weights: on a CPU target they are the resident working
set; on an accelerator the host copies them to the device one tensor at a time, and the device
holds the weights in the plan's dtype or format, the KV cache and the activations.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from portlayer.capabilities.plan import Plan, PlanError
from portlayer.capabilities.requirements import ITEMSIZE, ModelRequirements
from portlayer.flatten.weights_stream import IN_FLIGHT_BYTES

GiB = 1 << 30
#: the toolkit in a process (torch, transformers, the compiler), measured: ~0.5 GiB; with headroom
TOOLKIT_BYTES = 1 * GiB


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class MemoryNeeds:
    checkpoint_bytes: int  # the weights as the model source stores them
    compile_host_bytes: int
    serve_host_bytes: int
    serve_device_bytes: int  # 0 for a CPU target (it serves from host memory)
    reasons: Mapping[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint_bytes": self.checkpoint_bytes, "compile_host_bytes": self.compile_host_bytes,
                "serve_host_bytes": self.serve_host_bytes, "serve_device_bytes": self.serve_device_bytes,
                "reasons": dict(self.reasons)}  # fmt: skip

    def format_table(self) -> str:
        rows = [("compile, host", self.compile_host_bytes), ("serve, host", self.serve_host_bytes),
                ("serve, device", self.serve_device_bytes)]  # fmt: skip
        lines = [f"memory needs (weights as stored: {_gib(self.checkpoint_bytes)})"]
        keys = ("compile_host", "serve_host", "serve_device")
        for (label, n), key in zip(rows, keys):
            lines.append(f"  {label:<14} {_gib(n):>11}  {self.reasons.get(key, '')}")
        return "\n".join(lines)


def checkpoint_bytes(model_dir: Path | None, req: ModelRequirements) -> tuple[int, str]:
    """Bytes of the *.safetensors / *.bin weights in ``model_dir``, else the config's parameter count."""
    if model_dir is not None and Path(model_dir).is_dir():
        files = [p for p in Path(model_dir).glob("*.safetensors")] or [p for p in Path(model_dir).glob("*.bin")]
        if files:
            return sum(p.stat().st_size for p in files), f"{len(files)} weight file(s) in {model_dir}"
    return req.param_bytes, f"{req.param_count:,} parameters at {req.dtype}"


def memory_needs(req: ModelRequirements, plan: Plan, device_type: str, stored_bytes: int | None = None) -> MemoryNeeds:
    """The needs of compiling ``req`` into ``plan`` and of serving it on a ``device_type`` device."""
    stored = int(stored_bytes if stored_bytes is not None else req.param_bytes)
    dt = plan.value("compute_dtype")
    try:
        q = plan.value("weight_quantization") or "none"
    except KeyError:
        q = "none"
    lossy = q not in ("none",)
    largest = max((n * k for n, k in req.gemm_shapes), default=0) * 4  # a float32 tensor in flight
    in_flight = max(IN_FLIGHT_BYTES, 2 * largest)  # the writer's bound (flatten/weights_stream.py)
    gate = req.param_bytes_at(q) if q in ("int8", "int4") else (stored if lossy else 0)
    compile_host = stored + TOOLKIT_BYTES + in_flight + gate
    why_c = (f"weights once as stored ({_gib(stored)}) + toolkit ({_gib(TOOLKIT_BYTES)}) + tensors in flight "
             f"({_gib(in_flight)})" + (f" + the {q} weights, held beside the originals for the quality gate "
                                       f"({_gib(gate)})" if gate else ""))
    served = req.param_bytes_at(q if q in ("int8", "int4") else dt)
    try:
        kv = int(plan.value("kv_cache_budget_bytes") or 0)
    except KeyError:
        kv = 0
    try:
        act = 2 * int(plan.value("max_batched_tokens")) * _activation_bytes(req, dt)
    except KeyError:
        act = 0
    if device_type == "cpu":
        serve_host = served + kv + act + TOOLKIT_BYTES
        why_s = f"weights at {q if lossy else dt} ({_gib(served)}) + KV cache ({_gib(kv)}) + activations ({_gib(act)}) + toolkit"
        device, why_d = 0, "a CPU target serves from host memory"
    else:
        serve_host = TOOLKIT_BYTES + in_flight
        why_s = "toolkit + tensors in flight (the artifact's weights are memory-mapped and copied to the device per tensor)"
        device = served + kv + act
        why_d = f"weights at {q if lossy else dt} ({_gib(served)}) + KV cache ({_gib(kv)}) + activations ({_gib(act)})"
    return MemoryNeeds(stored, int(compile_host), int(serve_host), int(device),
                       {"compile_host": why_c, "serve_host": why_s, "serve_device": why_d})


def _activation_bytes(req: ModelRequirements, dtype: str) -> int:
    return int((4 * req.hidden_size + 3 * req.intermediate_size + req.vocab_size) * ITEMSIZE[dtype])


def host_memory_bytes() -> tuple[int, str]:
    """This machine's memory: $PORTLAYER_HOST_MEMORY (bytes) if set, else the physical pages the OS reports."""
    env = os.environ.get("PORTLAYER_HOST_MEMORY")
    if env:
        try:
            return int(float(env)), "$PORTLAYER_HOST_MEMORY"
        except ValueError:
            raise PlanError(f"$PORTLAYER_HOST_MEMORY={env!r} is not a number of bytes") from None
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "this machine's memory"
    except (ValueError, OSError, AttributeError):  # not POSIX: psutil if present, else no check
        try:
            import psutil

            return int(psutil.virtual_memory().total), "this machine's memory"
        except ImportError:
            return 1 << 62, "unknown (no check)"


def check_host(needs: MemoryNeeds, available: int, where: str, serving_here: bool) -> None:
    """Refuse, before anything is loaded, a compile (or a CPU serve) this machine cannot hold."""
    if needs.compile_host_bytes > available:
        raise PlanError(
            f"compiling needs {_gib(needs.compile_host_bytes)} of host memory ({needs.reasons['compile_host']}), "
            f"but {where} is {_gib(available)}; compile on a machine with more memory, or a smaller model"
        )
    if serving_here and needs.serve_host_bytes > available:
        raise PlanError(
            f"serving needs {_gib(needs.serve_host_bytes)} of host memory ({needs.reasons['serve_host']}), but {where} "
            f"is {_gib(available)}; quantize (--quantization int8) or serve on a machine with more memory"
        )
