"""The pass pipeline: PASSES in order, the verifier between passes when asked (always in tests),
and the IR text after every pass on request (``dump_dir`` or $PORTLAYER_DUMP_PASSES)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from portlayer.capabilities.descriptor import Descriptor, load_descriptor
from portlayer.capabilities.plan import Plan
from portlayer.capabilities.policy import plan_for_graph
from portlayer.flatten.ir import Graph
from portlayer.passes.context import PassContext
from portlayer.passes.cse import cse
from portlayer.passes.dce import dce
from portlayer.passes.fold import fold
from portlayer.passes.fuse import fuse
from portlayer.passes.memory_plan import memory_plan
from portlayer.passes.precision import precision
from portlayer.passes.quantize import quantize
from portlayer.passes.select import select
from portlayer.passes.shard import shard, world_size_of

PassFn = Callable[[Graph, PassContext], Graph]
PASSES: list[tuple[str, PassFn]] = [
    ("dce", dce), ("cse", cse), ("fold", fold), ("precision", precision), ("quantize", quantize),
    ("select", select), ("fuse", fuse), ("memory_plan", memory_plan),
]  # fmt: skip


@dataclass
class PipelineResult:
    graph: Graph
    plan: Plan
    descriptor: Descriptor
    history: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def pass_names() -> list[str]:
    return [n for n, _ in PASSES]


def _summary(name: str, before: Graph, after: Graph, seconds: float) -> dict[str, Any]:
    s: dict[str, Any] = {"nodes_before": len(before.nodes), "nodes_after": len(after.nodes),
                         "params_before": len(before.params), "params_after": len(after.params),
                         "seconds": round(seconds, 4)}
    if name == "select":
        fams: dict[str, int] = {}
        for n in after.nodes:
            fams[n.meta.get("impl_family", "?")] = fams.get(n.meta.get("impl_family", "?"), 0) + 1
        s["impl_families"] = fams
        s["fallbacks"] = [n.name for n in after.nodes if n.meta.get("impl") == "reference"]
    if name == "fuse":
        s["kernels"] = len(after.meta.get("kernels", []))
    if name == "memory_plan":
        m = after.meta["memory_plan"]
        s.update(arena_bytes=m["arena_bytes"], buffers=len(m["buffers"]))
    return s


def _should_verify(verify: bool | None) -> bool:
    if verify is not None:
        return verify
    return "PYTEST_CURRENT_TEST" in os.environ or os.environ.get("PORTLAYER_VERIFY_PASSES") == "1"


def run_pipeline(
    graph: Graph,
    target: str | Descriptor,
    *,
    overrides: Mapping[str, Any] | None = None,
    stop_after: str | None = None,
    dump_dir: str | os.PathLike[str] | None = None,
    verify: bool | None = None,
    options: Mapping[str, Any] | None = None,
) -> PipelineResult:
    """Plan the model for ``target`` and run PASSES (up to ``stop_after``) on a copy of ``graph``."""
    if stop_after is not None and stop_after not in pass_names():
        raise ValueError(f"--after {stop_after!r} is not a pass; passes in order: {', '.join(pass_names())}")
    desc = target if isinstance(target, Descriptor) else load_descriptor(target if target != "auto" else _auto())
    plan = plan_for_graph(graph, desc, overrides)
    ctx = PassContext(desc, plan, dict(options or {}))
    dump = dump_dir or os.environ.get("PORTLAYER_DUMP_PASSES")
    check = _should_verify(verify)
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        _dump(Path(dump), 0, "input", graph)
    result = PipelineResult(graph.copy(), plan, desc)
    if world_size_of(ctx) > 1:  # tensor parallelism (docs/parallel.md): this rank's shard before every pass
        t0 = time.perf_counter()
        result.graph = shard(result.graph, ctx)
        result.history.append(("shard", _summary("shard", graph, result.graph, time.perf_counter() - t0)))
        if dump:
            _dump(Path(dump), 0, "shard", result.graph)
    for i, (name, fn) in enumerate(PASSES, start=1):
        t0 = time.perf_counter()
        before = result.graph
        result.graph = fn(before, ctx)
        result.history.append((name, _summary(name, before, result.graph, time.perf_counter() - t0)))
        if check:
            from portlayer.flatten.verify import VerificationError, verify_graph

            try:
                verify_graph(result.graph)
            except VerificationError as e:
                raise VerificationError([f"after pass {name!r}: {p}" for p in e.problems]) from e
        if dump:
            _dump(Path(dump), i, name, result.graph)
        if name == stop_after:
            break
    return result


def _auto() -> str:
    from portlayer.capabilities.probe import probe_devices

    for d in probe_devices():
        if d.usable and d.descriptor:
            return d.descriptor
    return "cpu-x86_64"


def _dump(d: Path, i: int, name: str, g: Graph) -> None:
    from portlayer.flatten.printer import print_graph

    (d / f"{i:02d}_{name}.py").write_text(print_graph(g, show_meta=True))


def inspect_report(result: PipelineResult) -> dict[str, Any]:
    from portlayer.passes.report import report

    return report(result)
