"""Calibration benchmarks that need a generated kernel (capabilities/ cannot import backends/).

`portlayer calibrate` passes ``extras(run_pipeline)`` to ``capabilities.calibrate.calibrate``; each
extra takes (device, sizes, progress, base descriptor name) and returns entries merged into the
measured results. The pipeline comes in as an argument because backends/ sits before passes/.

The GEMM crossover: a chain of K = N = ``sizes.gemm_k`` linears compiled as the compiler compiles a
model's, run with the generated Triton GEMM and with the vendor GEMM at each M of ``sizes.gemm_ms``,
each step captured in a CUDA graph so device time is compared, not Python launch cost. The chain's
weights together exceed the last-level cache (``chain_length``): in a model every layer's weights
stream from memory, and one 4096 x 4096 weight (33.5 MB) timed alone stays in a 50 MB L2. The largest
M up to which Triton wins becomes ``tuning.triton_gemm_max_tokens``, and the largest M up to which the
few-rows kernel (gemv) beats both becomes ``tuning.gemv_max_tokens``: the rules codegen follows.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from portlayer.capabilities.calibrate import Extra
from portlayer.capabilities.calibrate_timing import Progress, Sizes, sig
from portlayer.capabilities.descriptor import load_descriptor
from portlayer.flatten.ir import GraphBuilder, TensorType
from portlayer.flatten.op_defs.attention import AttentionMetadata

ALWAYS_TRITON = 1 << 30
GEMV_MAX_ROWS = 64  # the few-rows kernel is timed up to this M (it is a decode kernel)


#: the chain's weights together are at least this many bytes (above the largest last-level caches, 256 MB)
CHAIN_MIN_BYTES = 320 << 20
CHAIN_MAX = 256  # K = 1024 (2 MiB in bf16) needs 160 to pass 320 MB


def chain_length(k: int, dtype: torch.dtype) -> int:
    """Linears in a timed chain of K = N = ``k``: enough that their weights pass every cache, 2..CHAIN_MAX."""
    per = k * k * torch.empty((), dtype=dtype).element_size()
    return max(2, min(CHAIN_MAX, -(-CHAIN_MIN_BYTES // per)))


def chained_linears(k: int, r: int, dtype: torch.dtype) -> Any:
    """x[num_tokens, K] -> linear(W_1) -> ... -> linear(W_r), all K x K: r GEMMs of distinct weights in one
    step (no two share an input, so no fusion joins them); a linear's time is the step's / r."""
    b = GraphBuilder()
    h = b.add_input("x", TensorType(str(dtype).removeprefix("torch."), ("num_tokens", k)))
    g = torch.Generator().manual_seed(0)
    for i in range(r):
        w = b.add_param(f"w{i}", (torch.randn(k, k, generator=g) / k**0.5).to(dtype))
        h = b.add1("linear", [h, w, None], name=f"proj{i}")
    b.graph.outputs = [h]
    b.graph.meta = {"architecture": "calibration-gemm"}
    return b.graph


def _device_us(prog: Any, feeds: dict[str, torch.Tensor], device: torch.device, iters: int) -> tuple[float, str]:
    """Microseconds per step: replayed from a CUDA graph where capture works, else eager (said so).

    The step's metadata is built on the device before capture (a host-to-device copy cannot be captured)."""
    md = AttentionMetadata.single(int(feeds["x"].shape[0]), device=device)

    def step() -> Any:
        return prog.run(feeds, md, None)

    for _ in range(3):
        step()
    torch.cuda.synchronize(device)
    how = "graph"
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        fn = g.replay
    except RuntimeError:
        fn, how = step, "eager"
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters, how


def _host_us(prog: Any, feeds: dict[str, torch.Tensor], device: torch.device, iters: int) -> float:
    """Microseconds per eager step of a program (a chain of 1-8 generated kernels): what launching them costs the host."""
    md = AttentionMetadata.single(int(feeds["x"].shape[0]), device=device)
    for _ in range(3):
        prog.run(feeds, md, None)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        prog.run(feeds, md, None)
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / iters * 1e6


def crossover(points: list[dict[str, Any]]) -> int:
    """Largest M of the leading run where the Triton GEMM is at least as fast as the vendor one (0: never)."""
    best = 0
    for p in points:
        if p["triton_us"] > p["vendor_us"]:
            break
        best = p["m"]
    return best


def _planned(pipeline: Callable[..., Any], graph: Any, desc: Any, dtype: torch.dtype) -> Any:
    """The pipeline's result for a calibration graph, in ``dtype``, unquantized."""
    return pipeline(graph, desc, overrides={"compute_dtype": str(dtype).removeprefix("torch."),
                                            "weight_quantization": "none"})


def _load(result: Any, dev: torch.device, out: Path, gemm_rule: int = 0, gemv_rule: int = 0, dot_rule: int = 0,
          binaries: bool = False) -> Any:
    """The generated program of ``result`` under the given GEMM rules, written to ``out`` and loaded eager
    (no CUDA graphs of its own: the benchmarks capture what they time). ``binaries``: its kernels compiled
    ahead of time for the device and launched as an artifact's are (codegen/kernel_binaries.py), not through
    Triton's JIT launcher, whose host cost per launch is several times larger."""
    from portlayer.backends.generate import generate
    from portlayer.backends.triton_program import load_program
    from portlayer.codegen.program import write_program

    write_program(generate(result.graph, result.plan, result.descriptor, gemm_max_tokens=gemm_rule,
                           gemv_max_tokens=gemv_rule, gemv_dot_max_tokens=dot_rule), out)
    src = with_binaries(out, result.descriptor) if binaries and dev.type == "cuda" else None
    if src is not None:
        from portlayer.codegen.kernel_binaries import KernelBinaryError

        try:
            return load_program(out, result.graph.weights, str(dev), result.plan, use_graphs=False, sources=src)
        except KernelBinaryError:  # binaries for another arch or driver (--base names another device): the JIT
            pass
    return load_program(out, result.graph.weights, str(dev), result.plan, use_graphs=False)


def launcher(prog: Any) -> str:
    """How a loaded program launches its generated kernels: "binaries" (codegen/kernel_binaries.py) or "jit"."""
    from portlayer.codegen.kernel_binaries import BinaryKernel, BinaryVariants

    kernels = vars(getattr(prog, "K", None) or SimpleNamespace()).values()
    return "binaries" if any(isinstance(k, (BinaryKernel, BinaryVariants)) for k in kernels) else "jit"


def with_binaries(out: Path, desc: Any) -> Any | None:
    """The generated program's files with its kernels compiled for ``desc`` in this process (codegen/aot.py's
    binaries.json and binaries/), for load_program; None where the target has no binaries."""
    from portlayer.codegen.aot import (
        BINARIES_DIR,
        BINARIES_INDEX,
        PDL_FEATURE,
        descriptor_target,
        write_binaries,
    )
    from portlayer.codegen.program import PROGRAM_LAYOUT
    from portlayer.codegen.source_loader import read_directory

    target = descriptor_target(desc)
    if target is None:
        return None
    saved = dict(os.environ)  # the compile may point Triton at another ptxas: not for the rest of calibrate
    try:
        write_binaries(out, target[2], jobs=1, pdl=desc.has(PDL_FEATURE))
    except Exception:  # noqa: BLE001 - a toolchain that cannot compile here: the kernels launch through the JIT
        return None
    finally:
        for k in set(os.environ) - set(saved):
            del os.environ[k]
        os.environ.update(saved)
    return read_directory(out, ("*.py", PROGRAM_LAYOUT, "kernels/*.py", BINARIES_INDEX, f"{BINARIES_DIR}/*"))


def _program(pipeline: Callable[..., Any], graph: Any, desc: Any, dtype: torch.dtype, dev: torch.device, out: Path,
             gemm_rule: int, gemv_rule: int, dot_rule: int = 0, binaries: bool = False) -> Any:
    return _load(_planned(pipeline, graph, desc, dtype), dev, out, gemm_rule, gemv_rule, dot_rule, binaries)


#: chain lengths whose eager steps give the per-kernel host cost as a slope
HOST_CHAIN = (1, 2, 4, 8)


def measure_eager_kernel_host(pipeline: Callable[..., Any], dev: torch.device, desc: Any, dtype: torch.dtype,
                              k: int, tmp: str, launchers: set[str] | None = None) -> tuple[float, float]:
    """(host microseconds of an eager one-kernel step, what each further generated kernel adds): the
    least-squares line through eager steps of chains of 1, 2, 4 and 8 linears (the Triton GEMM at one row),
    their kernels launched from precompiled binaries as a compiled artifact's are (since session 10).
    A slope over four lengths, not the difference of two timings, which moved 22 -> 46 us between runs."""
    launchers = set() if launchers is None else launchers  # filled with how the chains launched ("binaries"/"jit")
    xs, ys = [], []
    with tempfile.TemporaryDirectory(prefix="portlayer-host-", dir=tmp) as sub:
        progs = [(r, _program(pipeline, chained_linears(k, r, dtype), desc, dtype, dev, Path(sub) / f"chain-{r}",
                              ALWAYS_TRITON, 0, binaries=True)) for r in HOST_CHAIN]  # loaded outside inference mode
        launchers.update(launcher(p) for _, p in progs)
        with torch.inference_mode():
            x = torch.randn(1, k, device=dev, dtype=dtype)
            for _ in range(2):  # interleaved rounds, each length's best kept: a slow spell hits all lengths alike
                for r, prog in progs:
                    xs.append(float(r))
                    ys.append(_host_us(prog, {"x": x}, dev, 200))
    return host_line(list(zip(xs, ys)))


def host_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(one-kernel step us, per-kernel us) of the least-squares line through each chain length's best
    (kernels, host us) timing; the slope at least 0, the one-kernel step at least the slope."""
    best = {r: min(y for x_, y in points if x_ == r) for r, _ in points}
    rs = sorted(best)
    mean_r, mean_y = sum(rs) / len(rs), sum(best[r] for r in rs) / len(rs)
    spread = sum((r - mean_r) ** 2 for r in rs)
    slope = max(0.0, sum((r - mean_r) * (best[r] - mean_y) for r in rs) / spread) if spread else 0.0
    return max(slope, mean_y - slope * (mean_r - 1)), slope


def _path_times(pipeline: Callable[..., Any], dev: torch.device, desc: Any, dtype: torch.dtype, k: int,
                paths: Any, iters: int, tmp: str) -> tuple[dict[str, dict[int, float]], set[str]]:
    """{path: {M: device us}} of one K = N = ``k`` linear under each (name, gemm rule, gemv rule, Ms) path
    (a chain's step / its length: weights past the caches), and the timing modes used."""
    r = chain_length(k, dtype)
    chain = _planned(pipeline, chained_linears(k, r, dtype), desc, dtype)
    times: dict[str, dict[int, float]] = {}
    modes = set()
    for name, gemm_rule, gemv_rule, dot_rule, ms in paths:
        prog = _load(chain, dev, Path(tmp) / f"{name}-{k}", gemm_rule, gemv_rule, dot_rule)  # outside inference mode
        times[name] = {}
        with torch.inference_mode():
            for m in ms:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                us, how = _device_us(prog, {"x": x}, dev, max(3, iters // r))
                times[name][m] = us / r
                modes.add(f"{how}, chain of {r}")
    return times, modes


def measure_gemm_crossover(pipeline: Callable[..., Any], dev: torch.device, sizes: Sizes, progress: Progress,
                           base: str) -> dict[str, Any]:
    desc = load_descriptor(base)
    progress.start(f"GEMM crossover (generated Triton vs vendor) M={list(sizes.gemm_ms)} K=N={sizes.gemm_k}")
    if dev.type != "cuda" or desc.codegen != "triton":
        progress.done(f"not measured: {desc.name} generates {desc.codegen!r} code; no generated GEMM to compare")
        return {}
    dtype = torch.bfloat16 if "bf16" in desc.raw["throughput_tflops"] else torch.float16
    gemv_ms = [m for m in sizes.gemm_ms if m <= GEMV_MAX_ROWS]
    dot_ms = [m for m in gemv_ms if m > 1]
    paths = (("triton", ALWAYS_TRITON, 0, 0, sizes.gemm_ms), ("vendor", 0, 0, 0, sizes.gemm_ms),
             ("gemv", 0, GEMV_MAX_ROWS, 0, gemv_ms),  # the CUDA-core few-rows kernel at every M
             ("gemv_dot", 0, 1, GEMV_MAX_ROWS, dot_ms))  # its tensor-core tier above one row  # fmt: skip
    small_k = max(64, sizes.gemm_k // 4)  # 1024 at K = 4096: a small decoder's projections
    with tempfile.TemporaryDirectory(prefix="portlayer-crossover-") as tmp:
        times, modes = _path_times(pipeline, dev, desc, dtype, sizes.gemm_k, paths, sizes.iters, tmp)
        # the generated kernels again at a small K = N: with the large one, a fixed cost plus a part that grows
        # with K*N (a decoder's 1-3k-wide GEMVs are mostly the fixed part), as the vendor curve has
        small, _ = _path_times(pipeline, dev, desc, dtype, small_k, paths[:1] + paths[2:], sizes.iters, tmp)
        launchers: set[str] = set()
        host, per_kernel = measure_eager_kernel_host(pipeline, dev, desc, dtype, small_k, tmp, launchers)
    points = [{"m": m, "triton_us": sig(times["triton"][m]), "vendor_us": sig(times["vendor"][m]),
               **({"gemv_us": sig(times["gemv"][m])} if m in times["gemv"] else {}),
               **({"gemv_dot_us": sig(times["gemv_dot"][m])} if m in times["gemv_dot"] else {})}
              for m in sizes.gemm_ms]  # fmt: skip
    points_small = [{"m": m, "triton_us": sig(small["triton"][m]),
                     **({"gemv_us": sig(small["gemv"][m])} if m in small["gemv"] else {}),
                     **({"gemv_dot_us": sig(small["gemv_dot"][m])} if m in small["gemv_dot"] else {})}
                    for m in sizes.gemm_ms]  # fmt: skip
    cross = crossover(points)
    gemv = crossover([{"m": p["m"], "triton_us": p["gemv_us"], "vendor_us": min(p["vendor_us"], p["triton_us"])}
                      for p in points if "gemv_us" in p])  # fmt: skip
    progress.done(f"Triton GEMM wins up to M={cross}, few-rows kernel up to M={gemv} (triton/vendor/gemv/gemv_dot us: "
                  + ", ".join(f"M={p['m']} {p['triton_us']:g}/{p['vendor_us']:g}/{p.get('gemv_us', '-')}/{p.get('gemv_dot_us', '-')}"
                              for p in points)
                  + f"; at K=N={small_k} triton/gemv/gemv_dot us: "
                  + ", ".join(f"M={p['m']} {p['triton_us']:g}/{p.get('gemv_us', '-')}/{p.get('gemv_dot_us', '-')}"
                              for p in points_small)
                  + f"; timed {'/'.join(sorted(modes))}); an eager generated-kernel step costs the host {host:.3g} us, "
                  f"each further kernel {per_kernel:.3g} us (launched through {'/'.join(sorted(launchers))})")
    return {"gemm_crossover": {"k": sizes.gemm_k, "dtype": str(dtype).removeprefix("torch."), "points": points,
                               "k_small": small_k, "points_small": points_small, "timing": sorted(modes),
                               "eager_launcher": "/".join(sorted(launchers))},
            "triton_gemm_max_tokens": cross, "gemv_max_tokens": gemv, "triton_launch_us": sig(host),
            # a slope over chain lengths: kept only when it is a plausible share of the one-kernel step
            "triton_kernel_us": sig(per_kernel) if 0.5 <= per_kernel <= host else None}


def one_attention(heads: tuple[int, int, int], dtype: torch.dtype) -> Any:
    """q, k, v [num_tokens, heads, dim] -> paged causal attention: the graph whose generated program the
    attention calibration times (its decode kernels: split-K attention and its reduce, and the KV write)."""
    hq, hkv, d = heads
    b = GraphBuilder()
    name = str(dtype).removeprefix("torch.")
    q = b.add_input("q", TensorType(name, ("num_tokens", hq, d)))
    k = b.add_input("k", TensorType(name, ("num_tokens", hkv, d)))
    v = b.add_input("v", TensorType(name, ("num_tokens", hkv, d)))
    b.graph.outputs = [b.add1("attention", [q, k, v], {"num_heads": hq, "num_kv_heads": hkv, "head_dim": d,
                                                         "scale": d**-0.5, "layer": 0}, name="attn")]
    b.graph.meta = {"architecture": "calibration-attention"}
    return b.graph


def measure_generated_attention(pipeline: Callable[..., Any], dev: torch.device, sizes: Sizes, progress: Progress,
                                base: str) -> dict[str, Any]:
    """Paged decode attention as a generated Triton program runs it (the split-K kernel, its reduce, the KV
    write), timed at ``sizes.attn_points`` from a replayed CUDA graph where capture works; the fit the cost
    model uses for Triton targets (calibration.attention_generated). Triton targets on CUDA only."""
    desc = load_descriptor(base)
    if dev.type != "cuda" or desc.codegen != "triton":
        return {}
    from portlayer.capabilities.calibrate_attention import measure_paged_attention

    dtype = torch.bfloat16 if "bf16" in desc.raw["throughput_tflops"] else torch.float16
    with tempfile.TemporaryDirectory(prefix="portlayer-attention-") as tmp:
        prog = _program(pipeline, one_attention(sizes.attn_heads, dtype), desc, dtype, dev, Path(tmp) / "attention",
                        0, 0)

        def run(ins: list[torch.Tensor], ctx: Any) -> Any:
            return prog.run(dict(zip(("q", "k", "v"), ins)), ctx.attn_metadata, ctx.kv_cache)

        from portlayer.codegen.host_support import kv_cache_dtype

        got = measure_paged_attention(dev, sizes, progress, dtype, run=run,
                                      label="generated split-K decode attention + reduce", graphed=True,
                                      cache_dtype=kv_cache_dtype(prog))
        progress.start("host cost of a replayed decode step, waited for (1 and 16 layers; batch 1 and the largest)")
        step = measure_graph_step(pipeline, dev, sizes, desc, dtype, tmp)
        progress.done("not measured: the plan captures no CUDA graphs" if step is None else
                      ", ".join(f"{p['layers']} layers, batch {p['batch']}: {p['host_us']:g} us" for p in step["points"]))
    return {"attention_generated": got, **({"graph_step": step} if step else {})}


#: decode-step programs of these many attention layers: the host cost that grows with a model's depth (one KV
#: cache pair per layer in the graph's pointer key, one more set of graph nodes) as a slope between them
GRAPH_STEP_LAYERS = (1, 16)
#: the inputs a causal LM's decode step copies into the graph's static buffers (flatten/logits.py adds the third)
DECODE_INPUTS = ("input_ids", "positions", "logits_indices")


def one_decode_step(heads: tuple[int, int, int], dtype: torch.dtype, vocab: int = 256, layers: int = 1,
                    max_positions: int = 4096) -> Any:
    """The smallest graph whose replayed decode step has a causal LM's host work: its three inputs (token ids,
    positions, the rows to return), ``layers`` paged attentions each with its own KV cache, the returned rows
    gathered at the end. Layer 0's queries are the token's embedding plus its position's; layer i's queries are
    layer i-1's output; every layer's keys and values are embeddings of the token."""
    hq, hkv, d = heads
    b = GraphBuilder()
    g = torch.Generator().manual_seed(0)
    ids = b.add_input("input_ids", TensorType("int64", ("num_tokens",)))
    pos = b.add_input("positions", TensorType("int64", ("num_tokens",)))
    rows = b.add_input(DECODE_INPUTS[2], TensorType("int64", ("num_seqs",)))

    def embed(name: str, index: str, n: int, width: int) -> str:
        table = b.add_param(f"{name}_table", torch.randn(n, width, generator=g).to(dtype))
        return b.add1("embedding", [table, index], name=f"{name}_embed")

    x = b.add1("add", [embed("q", ids, vocab, hq * d), embed("pos", pos, max_positions, hq * d)], name="q0")
    for i in range(layers):
        q = b.add1("reshape", [x], {"shape": ["num_tokens", hq, d]}, name=f"q{i}_heads")
        k, v = (b.add1("reshape", [embed(f"{n}{i}", ids, vocab, hkv * d)], {"shape": ["num_tokens", hkv, d]},
                       name=f"{n}{i}_heads") for n in "kv")
        a = b.add1("attention", [q, k, v], {"num_heads": hq, "num_kv_heads": hkv, "head_dim": d, "scale": d**-0.5,
                                            "layer": i}, name=f"attn{i}")
        x = b.add1("reshape", [a], {"shape": ["num_tokens", hq * d]}, name=f"attn{i}_flat")
    b.graph.outputs = [b.add1("index_select", [x, rows], {"dim": 0}, name="rows")]
    b.graph.meta = {"architecture": "calibration-decode-step", "max_positions": max_positions}
    return b.graph


def device_behind_sleep(run: Callable[[], Any], dev: torch.device, iters: int) -> float:
    """Median device microseconds of ``run()`` queued behind a ~2 ms sleep kernel: the host has submitted
    everything before the device reaches it, so the events time the device alone."""
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(4_000_000)
        e0.record()
        run()
        e1.record()
        torch.cuda.synchronize(dev)
        times.append(e0.elapsed_time(e1) * 1e3)
    return sorted(times)[len(times) // 2]


GRAPH_STEP_ROUNDS = 8  # rounds the timed steps of each batch are split into (interleaved)


def measure_graph_step(pipeline: Callable[..., Any], dev: torch.device, sizes: Sizes, desc: Any, dtype: torch.dtype,
                       tmp: str, context: int = 16, layers: tuple[int, ...] = GRAPH_STEP_LAYERS) -> dict[str, Any] | None:
    """Host microseconds a replayed decode step adds to its device time when each step is waited for (as
    `portlayer bench` times it): the copies into the static buffers, the graph's pointer key, the replay call,
    the output copy, the wait. Programs of ``layers`` attention layers (one_decode_step), at batch 1 and the
    largest batch of ``sizes.attn_points``: wall (run + synchronize, median of 200 in interleaved rounds) minus the same step's device
    time (timed behind a sleep kernel). The cost model takes the fixed part and the slope per layer."""
    from portlayer.backends.generate import generate
    from portlayer.backends.triton_program import load_program
    from portlayer.capabilities.calibrate_attention import paged_case
    from portlayer.codegen.program import write_program

    top = max(b for b, _ in sizes.attn_points)
    points = []
    for n_layers in layers:
        result = _planned(pipeline, one_decode_step(sizes.attn_heads, dtype, layers=n_layers), desc, dtype)
        if not result.plan.value("graph_capture_sizes"):
            break  # the plan captures no graphs for this program: what was measured (if anything) stands
        out = Path(tmp) / f"decode-step-{n_layers}"
        write_program(generate(result.graph, result.plan, result.descriptor), out)
        prog = load_program(out, result.graph.weights, str(dev), result.plan)
        with torch.inference_mode():
            steps = {}
            for batch in sorted({1, top}):
                _, ctx, _ = paged_case(batch, context, sizes.attn_heads, dtype, dev, prog.kv_dtype)
                caches = [ctx.kv_cache[0]] + [tuple(torch.zeros_like(c) for c in ctx.kv_cache[0])
                                              for _ in range(n_layers - 1)]
                md = ctx.attn_metadata
                feeds = {"input_ids": torch.randint(0, 256, (batch,), device=dev),
                         "positions": md.seq_lens.to(dev, torch.int64) - 1,
                         DECODE_INPUTS[2]: torch.arange(batch, device=dev)}

                def step(prog: Any = prog, feeds: dict[str, torch.Tensor] = feeds, md: Any = md,
                         caches: Any = caches) -> Any:
                    return prog.run(feeds, md, caches)

                for _ in range(5):
                    step()
                torch.cuda.synchronize(dev)
                if getattr(prog, "_graphs", None):  # else the step ran eagerly: not what this measures
                    steps[batch] = step
            # the batches' steps interleaved in rounds, so a drift of the host (clock, a neighbour) falls on
            # every point alike: timed one after the other, the batch-1 point of one call read 77 us and the
            # next call's 40 (session 12)
            walls: dict[int, list[float]] = {b: [] for b in steps}
            for _ in range(GRAPH_STEP_ROUNDS):
                for batch, step in steps.items():
                    for _ in range(200 // GRAPH_STEP_ROUNDS):
                        t0 = time.perf_counter()
                        step()
                        torch.cuda.synchronize(dev)
                        walls[batch].append(time.perf_counter() - t0)
            for batch, step in steps.items():
                wall = sorted(walls[batch])[len(walls[batch]) // 2] * 1e6
                device = device_behind_sleep(step, dev, 50)
                points.append({"batch": batch, "layers": n_layers, "wall_us": sig(wall), "device_us": sig(device),
                               "host_us": sig(max(0.0, wall - device))})
    return {"context": context, "inputs": list(DECODE_INPUTS), "points": points} if points else None


def measure_torch_attention(dev: torch.device, sizes: Sizes, progress: Progress, base: str) -> dict[str, Any]:
    """Paged attention as a torch-codegen program runs it (codegen/torch_attention.py: one batched sdpa per
    step), replacing the op-reference measurement capabilities/ can make on its own."""
    if load_descriptor(base).codegen != "torch":
        return {}
    from portlayer.capabilities.calibrate_attention import measure_paged_attention
    from portlayer.codegen.torch_attention import attention_batched

    d = sizes.attn_heads[2]
    workspace: dict[str, torch.Tensor] = {}  # kept across calls, as a program keeps it across steps

    def run(ins: list[torch.Tensor], ctx: Any) -> torch.Tensor:
        st = SimpleNamespace(meta=ctx.attn_metadata, kv_caches=ctx.kv_cache, workspace=workspace)
        return attention_batched(*ins, st, layer=0, scale=d**-0.5, causal=True, sliding_window=None)

    return {"attention": measure_paged_attention(dev, sizes, progress, torch.float32, run=run,
                                                 label="torch.sdpa, codegen/torch_attention.py")}


def extras(pipeline: Callable[..., Any] | None = None) -> list[Extra]:
    """The backend benchmarks; ``pipeline`` is passes.pipeline.run_pipeline (the CLI hands it in)."""
    from portlayer.backends.calibration_torch import measure_torch_nodes

    out: list[Extra] = [measure_torch_attention, measure_torch_nodes]
    if pipeline is not None:
        out.append(lambda dev, sizes, progress, base: measure_gemm_crossover(pipeline, dev, sizes, progress, base))
        out.append(lambda dev, sizes, progress, base: measure_generated_attention(pipeline, dev, sizes, progress, base))
    return out
