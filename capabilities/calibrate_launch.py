"""Kernel launch latency: eagerly, and inside a replayed graph where the device has graphs.

A decode step of a small model is dozens of tiny kernels; what each launch costs, and what it
costs once the step is captured into a CUDA graph, is most of that step's time.
"""

from __future__ import annotations

import time

import torch

from portlayer.capabilities.calibrate_timing import Progress, Sizes, measure_s, sync, trimmed


def measure_launch_latency(device: torch.device, sizes: Sizes) -> float:
    """Microseconds per tiny op launched eagerly (host time, the queue kept full)."""
    x = torch.zeros(1, device=device)
    for _ in range(100):
        x.add_(1)
    sync(device)
    if device.type != "cuda":  # the host clock of every CPU benchmark, the fastest half of many short runs
        return measure_s(lambda: x.add_(1), device, sizes, sizes.budget_s, sizes.launches) * 1e6
    runs = []
    for _ in range(max(1, sizes.reps)):
        t0 = time.perf_counter()
        for _ in range(sizes.launches):
            x.add_(1)
        sync(device)
        runs.append(time.perf_counter() - t0)
    return trimmed(runs) / sizes.launches * 1e6


def _tiny_graph(x: torch.Tensor, kernels: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1)
    for _ in range(3):
        graph.replay()
    return graph


def measure_graph_launch(device: torch.device, sizes: Sizes, kernels: int = 200) -> tuple[float, float] | None:
    """(microseconds per tiny kernel inside a replayed CUDA graph, replays queued back to back; what each
    node adds beyond that to a replay that is waited for, i.e. host submission the device cannot hide); None
    where there are no graphs. The second: (one waited replay of ``kernels`` nodes - one of a single node) /
    (kernels - 1) - the first, at least 0."""
    if device.type != "cuda":
        return None
    x = torch.zeros(1, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            x.add_(1)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph, single = _tiny_graph(x, kernels), _tiny_graph(x, 1)
    sync(device)
    reps = max(1, sizes.launches // kernels)
    runs = []
    for _ in range(max(1, sizes.reps)):
        t0 = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        sync(device)
        runs.append(time.perf_counter() - t0)
    per_kernel = trimmed(runs) / (reps * kernels) * 1e6

    def waited(g: torch.cuda.CUDAGraph) -> float:
        times = []
        for _ in range(max(20, 4 * reps)):
            t0 = time.perf_counter()
            g.replay()
            sync(device)
            times.append(time.perf_counter() - t0)
        return trimmed(times) * 1e6

    node = (waited(graph) - waited(single)) / (kernels - 1) - per_kernel
    return per_kernel, max(0.0, node)


def measure_reference_op(device: torch.device, sizes: Sizes) -> float:
    """Microseconds per graph node the torch codegen family runs: an op's reference implementation
    (what its host program calls per node, several torch calls each) on one-token tensors."""
    from portlayer.flatten.ops import get_op

    h = 64
    x, w = torch.randn(1, h, device=device), torch.randn(h, h, device=device)
    calls = [(get_op("rms_norm"), [x, torch.ones(h, device=device)], {"eps": 1e-6}),
             (get_op("add"), [x, x], {}), (get_op("silu"), [x], {}), (get_op("mul"), [x, x], {}),
             (get_op("linear"), [x, w, None], {})]  # fmt: skip
    calls = [(op, ins, op.complete_attrs(a)) for op, ins, a in calls]

    def run() -> None:
        for op, ins, attrs in calls:
            op.reference(ins, attrs)

    with torch.inference_mode():
        for _ in range(10):
            run()
        sync(device)
        return measure_s(run, device, sizes, sizes.budget_s, max(1, sizes.launches // 20)) / len(calls) * 1e6


def measure_launches(device: torch.device, sizes: Sizes, progress: Progress) -> dict[str, float | None]:
    progress.start("launch latency (eager)")
    eager = measure_launch_latency(device, sizes)
    progress.done(f"{eager:.3g} us per tiny op")
    progress.start("torch-family node (an op's reference implementation on one token)")
    ref = measure_reference_op(device, sizes)
    progress.done(f"{ref:.3g} us per node")
    progress.start("launch latency (replayed graph)")
    graph = node = None
    try:
        got = measure_graph_launch(device, sizes)
    except RuntimeError as e:  # a driver without graph support: say so, keep the eager number
        progress.done(f"not measured: {str(e)[:120]}")
    else:
        if got is None:
            progress.done("not measured: this device has no graphs")
        else:
            graph, node = got
            progress.done(f"{graph:.3g} us per kernel; a waited replay adds {node:.3g} us per node")
    return {"eager_us": eager, "graph_us": graph, "graph_node_host_us": node, "reference_op_us": ref}
