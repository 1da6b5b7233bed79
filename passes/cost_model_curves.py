"""The device side of the cost model: time of a memory-bound op, a GEMM, a paged attention read.

From a calibrated descriptor's ``calibration`` curves (bandwidth sweep, small-M GEMM curve,
paged-attention fit, launch latency) when it has them; from the peaks (bandwidth_gbps,
throughput_tflops, launch_overhead_us) otherwise. Pure functions of the descriptor's data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: the calibrated op whose costs stand in for an uncalibrated op of the same kind (flatten/ops.py kinds)
REPRESENTATIVE = {"pointwise": "mul", "reduction": "softmax", "data": "index_select", "sequence": "softmax"}
DTYPE_KEYS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "int8", "float64": "fp64"}


def interp_log(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear interpolation of ys over log(xs); clamped at both ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            f = (math.log(x) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
            return ys[i - 1] + f * (ys[i] - ys[i - 1])
    return ys[-1]


def _at(curve: Sequence[tuple[int, float]], m: int) -> float:
    """Microseconds at M rows from a (M, us) curve: log-interpolated, linear in M past its end (compute-bound)."""
    ms, us = [c[0] for c in curve], [c[1] for c in curve]
    return us[-1] * m / ms[-1] if m > ms[-1] else interp_log(m, ms, us)


def _fixed_plus_proportional(big_us: float, small_us: float, big_k: int, small_k: int, kn: int,
                             fixed_factor: float = 1.0) -> float:
    """A GEMM timed at K = N = big_k and small_k: a fixed cost (scaled by ``fixed_factor``) plus a part
    proportional to K*N, evaluated at ``kn``."""
    if big_k <= small_k:  # one size only (a hand-written descriptor): proportional to K*N from the big one
        return big_us * kn / max(big_k, 1) ** 2 * fixed_factor
    per = max(0.0, (big_us - small_us) / (big_k**2 - small_k**2))
    fixed = max(0.0, small_us - per * small_k**2) * fixed_factor
    return fixed + per * kn


@dataclass(frozen=True)
class Curves:
    """What the device sustains; every time in microseconds."""

    bandwidth_gbps: float
    tflops: Mapping[str, float]
    launch_us: float
    graph_launch_us: float | None
    sweep: tuple[tuple[int, float], ...] = ()  # (bytes, copy GB/s)
    sweep_read: tuple[float, ...] = ()  # the sweep's read GB/s (a sum) at each size
    gemm: Mapping[str, tuple[tuple[int, float], ...]] = None  # dtype -> (M, us at K = N = gemm_k)
    gemm_k: int = 0
    attention: Mapping[str, float] | None = None  # fixed_us, per_seq_us, gbps (torch-family fit)
    calibrated: bool = False
    attention_points: tuple[Mapping[str, Any], ...] = ()
    gemm_small: Mapping[str, tuple[tuple[int, float], ...]] = None  # the same curve at a small K = N
    gemm_small_k: int = 0
    node_us: float | None = None  # torch family: host cost of one node (its reference implementation)
    crossover: Mapping[str, tuple[tuple[int, float], ...]] = None  # path (triton, gemv) -> (M, us) at K = N = crossover_k
    crossover_k: int = 0
    crossover_small: Mapping[str, tuple[tuple[int, float], ...]] = None  # the same paths at K = N = crossover_small_k
    crossover_small_k: int = 0
    generated_launch_us: float | None = None  # host cost of one eager step of a generated (Triton) kernel
    generated_kernel_us: float | None = None  # what each further generated kernel adds to an eager step's host time
    generated_attention: Mapping[str, float] | None = None  # fixed_us, per_seq_us, gbps of the generated decode attention
    attention_kernel: str | None = None  # what the attention calibration timed
    torch_nodes: Mapping[str, Mapping[str, float]] = None  # torch family: op -> {us, bytes, big_us, big_bytes}
    torch_step_us: float = 0.0  # torch family: what run() pays once per step (the step state)
    threads: int | None = None  # torch threads the calibration ran with
    host_factor: float = 1.0  # torch family: one-token calls in a program's sequence vs each in a tight loop
    cache_bytes: int | None = None  # the sweep's cache knee: a kernel moving more leaves the next one cold
    graph_step: tuple[tuple[int, int, float], ...] = ()  # (batch, layers, host us a waited replayed decode step adds)
    graph_step_inputs: int = 0  # inputs the calibrated decode-step program copies into its static buffers
    graph_node_us: float = 0.0  # what each graph node adds to a replay that is waited for (host submission)
    gemm_aspects: tuple[tuple[int, int, tuple[tuple[int, float], ...]], ...] = ()  # (K, N, (M, us)) skinny vendor GEMMs

    def graph_step_us(self, batch: int, layers: int = 1) -> float:
        """Host time of a replayed decode step beyond its device time (copies into the static buffers, the
        graph's KV pointer key, the replay call, the output copy, the wait): linear in the batch between the
        calibrated points of each program depth, then linear in the number of attention layers between the
        two depths (the slope never below 0: a noisy pair must not make a deep model cheaper); 0 uncalibrated."""
        by_depth: dict[int, list[tuple[int, float]]] = {}
        for b, n, us in self.graph_step:
            by_depth.setdefault(n, []).append((b, us))
        if not by_depth:
            return 0.0

        def in_batch(pts: list[tuple[int, float]]) -> float:
            pts = sorted(pts)
            if len(pts) == 1 or batch <= pts[0][0]:
                return pts[0][1]
            (b0, u0), (b1, u1) = pts[0], pts[-1]
            return max(0.0, u0 + (u1 - u0) * (batch - b0) / max(1, b1 - b0))

        depths = sorted(by_depth)
        base = in_batch(by_depth[depths[0]])
        if len(depths) == 1:
            return base
        slope = max(0.0, (in_batch(by_depth[depths[-1]]) - base) / (depths[-1] - depths[0]))
        return base + slope * max(0, layers - depths[0])  # never below the shallowest calibrated program

    def ops_per_sequence(self) -> float | None:
        """Torch-family attention runs a handful of torch ops per sequence over that sequence's KV: how
        many sweep-sized ops one measured sequence cost (the median over the calibration points)."""
        if not (self.sweep and self.attention_points):
            return None
        ks = sorted(p["us"] / p["batch"] / self.memory_us(p["kv_bytes"] / p["batch"]) for p in self.attention_points)
        return ks[len(ks) // 2]

    @staticmethod
    def from_descriptor(raw: Mapping[str, Any]) -> Curves:
        cal = raw.get("calibration") or {}
        sweep = tuple((int(r["bytes"]), float(r["copy_gbps"])) for r in cal.get("bandwidth_sweep", ()))
        gemm = {k: tuple((int(r["m"]), float(r["us"])) for r in rows)
                for k, rows in (cal.get("gemm_curves") or {}).items() if rows}  # fmt: skip
        small = {k: tuple((int(r["m"]), float(r["us"])) for r in rows)
                 for k, rows in (cal.get("gemm_curves_small") or {}).items() if rows}  # fmt: skip
        cross = cal.get("gemm_crossover") or {}
        paths = {path: tuple((int(p["m"]), float(p[f"{path}_us"])) for p in cross.get("points", ()) if f"{path}_us" in p)
                 for path in ("triton", "gemv", "gemv_dot", "vendor")}  # fmt: skip
        paths_small = {path: tuple((int(p["m"]), float(p[f"{path}_us"])) for p in cross.get("points_small", ())
                                   if f"{path}_us" in p) for path in ("triton", "gemv", "gemv_dot")}  # fmt: skip
        launch = cal.get("launch_us") or {}
        attn = cal.get("attention") or {}
        gen = cal.get("attention_generated") or {}
        return Curves(
            bandwidth_gbps=float(raw["memory"]["bandwidth_gbps"]), tflops=dict(raw["throughput_tflops"]),
            launch_us=float(launch.get("eager_us") or raw.get("launch_overhead_us") or 5.0),
            graph_launch_us=launch.get("graph_us"), sweep=sweep,
            sweep_read=tuple(float(r.get("read_gbps") or 0.0) for r in cal.get("bandwidth_sweep", ())), gemm=gemm, gemm_k=int(cal.get("gemm_k") or 0),
            attention={k: float(attn[k]) for k in ("fixed_us", "per_seq_us", "gbps")} if "gbps" in attn else None,
            calibrated=bool(sweep), attention_points=tuple(attn.get("points") or ()), gemm_small=small,
            gemm_small_k=int(cal.get("gemm_small_k") or 0), node_us=launch.get("reference_op_us"),
            crossover={k: v for k, v in paths.items() if v}, crossover_k=int(cross.get("k") or 0),
            crossover_small={k: v for k, v in paths_small.items() if v}, crossover_small_k=int(cross.get("k_small") or 0),
            generated_launch_us=launch.get("triton_us"), attention_kernel=attn.get("kernel"),
            generated_kernel_us=launch.get("triton_kernel_us"),
            generated_attention={k: float(gen[k]) for k in ("fixed_us", "per_seq_us", "gbps")} if "gbps" in gen else None,
            torch_nodes=dict(cal.get("torch_nodes") or {}), torch_step_us=float(launch.get("torch_step_us") or 0.0),
            threads=cal.get("threads"), host_factor=float(cal.get("torch_sequence_factor") or 1.0),
            cache_bytes=cal.get("cache_knee_bytes"),
            graph_node_us=float(launch.get("graph_node_host_us") or 0.0),
            graph_step=tuple((int(p["batch"]), int(p.get("layers", 1)), float(p["host_us"]))
                             for p in (cal.get("graph_step") or {}).get("points", ())),
            gemm_aspects=tuple((int(a["k"]), int(a["n"]), tuple((int(p["m"]), float(p["us"])) for p in a["points"]))
                               for a in cal.get("gemm_aspects") or () if a.get("points")),
            graph_step_inputs=len((cal.get("graph_step") or {}).get("inputs") or ["input_ids"]),
        )  # fmt: skip

    def peak_tflops(self, dtype: str) -> float:
        key = DTYPE_KEYS.get(dtype, dtype)
        return float(self.tflops.get(key) or self.tflops.get("fp32") or min(self.tflops.values()))

    def memory_us(self, nbytes: float) -> float:
        """A memory-bound kernel moving ``nbytes`` (reads + writes)."""
        if nbytes <= 0:
            return 0.0
        if not self.sweep:
            return nbytes / (self.bandwidth_gbps * 1e3)
        sizes, gbps = [s for s, _ in self.sweep], [g for _, g in self.sweep]
        if nbytes <= sizes[0]:  # below the sweep: the smallest kernel's time is the floor
            return sizes[0] / (gbps[0] * 1e3)
        return nbytes / (interp_log(nbytes, sizes, gbps) * 1e3)

    def torch_node_us(self, op: str, kind: str, nbytes: float, cold: bool = False) -> float | None:
        """A torch-family node: its op's fixed cost through host_support.ref (in a program's sequence, or
        ``cold``: right after a kernel that swept the caches) plus the part that grows with its bytes,
        scaled from the calibrated cache-resident point along the bandwidth sweep; None when not
        calibrated. An op not in the table takes a calibrated op of its kind (REPRESENTATIVE)."""
        if not self.torch_nodes:
            return None
        e = self.torch_nodes.get(op) or self.torch_nodes.get(REPRESENTATIVE.get(kind, ""))
        if e is None:
            e = sorted(self.torch_nodes.values(), key=lambda v: v["us"])[len(self.torch_nodes) // 2]
        lo, hi = self.memory_us(e["bytes"]), self.memory_us(e["big_bytes"])
        grow = max(0.0, e["big_us"] - e["us"])
        warm = e["us"] * self.host_factor
        fixed = max(warm, float(e.get("cold_us") or 0.0)) if cold else warm
        if hi > lo:
            return fixed + grow * max(0.0, self.memory_us(nbytes) - lo) / (hi - lo)
        span = max(1.0, e["big_bytes"] - e["bytes"])
        return fixed + grow * max(0.0, nbytes - e["bytes"]) / span

    def read_gbps(self) -> float:
        """The sweep's read rate (a sum over the buffer) at its largest working set, past every cache, at least
        the copy bandwidth: what a kernel that only reads a cold weight can reach (a copy moves as many bytes
        written as read: 2.8 TB/s against a 4.3 TB/s read on the H200). Not the fastest read of the sweep,
        which on a CPU is a cache's (54 GB/s at 1 MiB against 9.8 from DRAM)."""
        largest = float(self.sweep_read[-1]) if self.sweep_read else 0.0
        return max(self.bandwidth_gbps, largest)

    def floor_us(self) -> float:
        return self.memory_us(1.0) if self.sweep else 0.0

    def gemm_us(self, m: int, k: int, n: int, flops: float, nbytes: float, dtype: str, path: str = "vendor") -> float:
        """One GEMM of M rows by a [N, K] weight: the calibrated small-M curve scaled by K*N, or the peaks.

        ``path`` triton / gemv / gemv_dot: the generated kernels' crossover timings where calibration measured
        them (gemv_dot, the few-rows kernels' tensor-core tier: the CUDA-core timings where it was not measured)."""
        floor = nbytes / (self.read_gbps() * 1e3)  # a GEMM reads its weight: no faster than the best read
        cross, cross_small = self.crossover or {}, self.crossover_small or {}
        if path == "gemv_dot" and "gemv_dot" not in cross:
            path = "gemv"
        measured = cross.get(path) if path != "vendor" else None
        if measured and self.crossover_k:
            at = _at(measured, m)
            small = cross_small.get(path)
            if small and self.crossover_small_k and m <= small[-1][0]:  # two sizes: fixed + proportional to K*N
                return max(_fixed_plus_proportional(at, _at(small, m), self.crossover_k, self.crossover_small_k, k * n),
                           floor)
            return max(at * (k * n) / self.crossover_k**2, floor)
        square = self._square_us(m, k * n, dtype)
        if square is None:
            return max(flops / (self.peak_tflops(dtype) * 1e6), floor)
        return max(square * self._aspect_factor(m, k, n, dtype), floor)

    def _square_us(self, m: int, kn: int, dtype: str) -> float | None:
        """The vendor GEMM of M rows by a weight of ``kn`` elements from the square (K = N) curves; None
        uncalibrated."""
        curve = self.gemm.get(DTYPE_KEYS.get(dtype, dtype)) if self.gemm else None
        if not curve or not self.gemm_k:
            return None
        at = _at(curve, m)
        small = self.gemm_small.get(DTYPE_KEYS.get(dtype, dtype)) if self.gemm_small else None
        if small and self.gemm_small_k:  # two sizes: fixed cost + a part proportional to K*N
            return _fixed_plus_proportional(at, _at(small, m), self.gemm_k, self.gemm_small_k, kn,
                                            self.host_factor if self.torch_nodes else 1.0)
        base = min(self.floor_us(), curve[0][1] * 0.5)
        return base + (at - base) * kn / self.gemm_k**2

    def _aspect_factor(self, m: int, k: int, n: int, dtype: str) -> float:
        """How much slower (or faster) than the square curves a K x N weight runs at M rows: the measured ratio
        at the calibrated skinny shape on the same side (wide: N > K, tall: K > N), scaled in log(N/K) from 1 at
        the square to the full ratio at the calibrated aspect and held beyond it; 1 where not calibrated."""
        if not self.gemm_aspects or k == n:
            return 1.0
        side = [(kc, nc, pts) for kc, nc, pts in self.gemm_aspects if (nc > kc) == (n > k) and nc != kc]
        if not side:
            return 1.0
        kc, nc, pts = side[0]
        square = self._square_us(m, kc * nc, dtype)
        if not square:
            return 1.0
        ratio = _at(pts, m) / square
        share = min(1.0, abs(math.log(n / k)) / abs(math.log(nc / kc)))
        return max(0.0, 1.0 + (ratio - 1.0) * share)

    def sweeps_caches(self, nbytes: float) -> bool:
        """Does a kernel moving ``nbytes`` leave the next one cold (more than the sweep's cache knee)?"""
        return bool(self.cache_bytes) and nbytes > float(self.cache_bytes)

    def cold_factor(self) -> float:
        """Median over the calibrated ops of cold / warm fixed cost (1 when not measured)."""
        r = sorted(v["cold_us"] / v["us"] for v in (self.torch_nodes or {}).values() if v.get("cold_us") and v["us"] > 0)
        return max(1.0, r[len(r) // 2]) if r else 1.0

    def batched_attention(self) -> bool:
        """The attention fit timed one batched call per step (the torch family's sdpa), not the op reference."""
        return "sdpa" in str(self.attention_kernel or "") and self.attention is not None

    def attention_us(self, batch: int, kv_bytes: float, flops: float, dtype: str, torch_family: bool,
                     cold: bool = False, decode: bool = True) -> float:
        """Paged attention of ``batch`` sequences reading ``kv_bytes`` of cache: the fit, else bytes and FLOPs.
        ``cold`` (torch family): right after a kernel that swept the caches, its host part costs ``cold_factor``x."""
        compute = flops / (self.peak_tflops(dtype) * 1e6)
        batched = self.batched_attention()  # one call for the whole step: the fit's terms
        k = self.ops_per_sequence() if torch_family and not batched else None
        if k is not None:  # per sequence: k ops, each costing what the sweep says an op of that size costs
            return batch * k * self.memory_us(kv_bytes / max(batch, 1)) + compute
        if torch_family and self.attention:
            a, f = self.attention, (self.host_factor if self.torch_nodes else 1.0)
            if cold:
                f = max(f, self.cold_factor())
            return (a["fixed_us"] + a["per_seq_us"] * batch) * f + kv_bytes / (a["gbps"] * 1e3) + compute
        if decode and not torch_family and self.generated_attention:  # the generated decode kernels, as a step runs them
            a = self.generated_attention
            return max(a["fixed_us"] + a["per_seq_us"] * batch + kv_bytes / (a["gbps"] * 1e3), compute)
        # the cache is read once per step: at the DRAM/HBM rate, not the cache-hot rate of a small sweep size
        return max(self.memory_us(kv_bytes), kv_bytes / (self.bandwidth_gbps * 1e3), compute)
