"""GEMM throughput: one large matmul per dtype, and the small-M (decode) efficiency curve.

The datasheet peak is what a square matmul of thousands reaches; a decode step multiplies a
handful of rows by each weight, where the vendor GEMM is bound by reading the weight, not by
FLOPs. The curve (M -> TFLOP/s and effective GB/s at K = N) is what the cost model reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from portlayer.capabilities.calibrate_timing import (
    Progress,
    Sizes,
    iters_for,
    measure_s,
    sig,
    sync,
    time_per_iter,
)

MATMUL_DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")
TORCH_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                "fp16": torch.float16}  # fmt: skip
COMPUTE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _matmul_fn(dtype: str, n: int, device: torch.device) -> Callable[[], Any] | None:
    if dtype == "int8":
        if not hasattr(torch, "_int_mm"):
            return None
        a = torch.randint(-8, 8, (n, n), dtype=torch.int8, device=device)
        b = torch.randint(-8, 8, (n, n), dtype=torch.int8, device=device)
        return lambda: torch._int_mm(a, b)
    if dtype == "fp8":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            return None
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    a = torch.randn(n, n, device=device, dtype=TORCH_DTYPES[dtype])
    b = torch.randn(n, n, device=device, dtype=TORCH_DTYPES[dtype])
    return lambda: torch.mm(a, b)


def measure_matmul(device: torch.device, dtype: str, sizes: Sizes) -> float | None:
    """Dense n^3 matmul TFLOP/s (TOP/s for int8); None when this torch/device cannot run it."""
    if dtype == "tf32" and device.type != "cuda":
        return None
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        n = sizes.matmul_n
        fn = _matmul_fn(dtype, n, device)
        if fn is None:
            return None
        iters = iters_for(fn, device, sizes.max_seconds_per_dtype / max(1, sizes.reps), sizes.iters)
        t = time_per_iter(fn, device, iters, min(sizes.warmup, iters), sizes.reps)
        return 2 * n**3 / t / 1e12
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def measure_matmuls(device: torch.device, sizes: Sizes, progress: Progress) -> dict[str, float]:
    """dtype -> TFLOP/s for every dtype this torch/device runs (unsupported ones left out)."""
    out = {}
    for k in MATMUL_DTYPES:
        progress.start(f"matmul {k} {sizes.matmul_n}^3")
        v = measure_matmul(device, k, sizes)
        if v is not None and v == v and v > 0 and v != float("inf"):
            out[k] = v
            progress.done(f"{v:.4g} TFLOP/s")
        else:
            progress.done("not measured: this torch/device has no such matmul")
    return out


def _vendor_mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> Any:
    return torch.mm(x, w.t(), out=out)


def measure_small_m(device: torch.device, dtype: str, sizes: Sizes, progress: Progress, k: int | None = None,
                    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any] = _vendor_mm,
                    label: str = "torch.mm", n: int | None = None) -> list[dict[str, Any]]:
    """The vendor GEMM as the compiled program calls it (``run(x, W, out)``, default torch.mm(x, W.t(), out=...))
    at M rows x K=k (default ``sizes.gemm_k``; a second, small K gives the fixed cost a GEMM pays whatever its
    size) x N=n (default k; :func:`measure_aspects` times the skinny shapes a model's projections have).
    A backend passes the call its programs make (the torch family: the linear op through host_support.ref)."""
    import itertools

    k = k or sizes.gemm_k
    n = n or k
    w = torch.randn(n, k, device=device, dtype=TORCH_DTYPES[dtype]) / k**0.5
    nbytes = w.numel() * w.element_size()
    copies = max(1, min(1024, sizes.cold_bytes // nbytes)) if nbytes >= sizes.cold_min_bytes else 1
    weights = itertools.cycle([w] + [w.clone() for _ in range(copies - 1)])  # Sizes.cold_bytes: read cold
    rows = []
    progress.start(f"decode GEMM curve {dtype} ({label}) M={list(sizes.gemm_ms)} "
                   + (f"K=N={k}" if n == k else f"K={k} N={n}")
                   + (f", cycling {copies} weight copies" if copies > 1 else ""))
    for m in sizes.gemm_ms:
        x = torch.randn(m, k, device=device, dtype=w.dtype)
        out = torch.empty(m, n, device=device, dtype=w.dtype)
        fn = lambda x=x, out=out: run(x, next(weights), out)  # noqa: E731
        fn()
        sync(device)
        t = measure_s(fn, device, sizes, sizes.budget_s, 200, graphed=True)
        moved = (m * k + n * k + m * n) * w.element_size()
        rows.append({"m": m, "tflops": sig(2 * m * k * n / t / 1e12), "gbps": sig(moved / t / 1e9), "us": sig(t * 1e6)})
    progress.done(", ".join(f"M={r['m']} {r['tflops']:g} TFLOP/s" for r in rows))
    return rows


#: how much longer than wide (and wider than long) the skinny shapes are: a transformer's projections run
#: from hidden -> 3-8x hidden (Q|K|V, gate|up) to 3-4x hidden -> hidden (down, o)
ASPECT = 4


def measure_aspects(device: torch.device, dtype: str, sizes: Sizes, progress: Progress) -> list[dict[str, Any]]:
    """The vendor GEMM at a wide (K, ASPECT*K) and a tall (ASPECT*K, K) weight of the same K*N as the square
    (2K)^2, K = gemm_k // 4: at 16-64 rows a vendor GEMM on a skinny projection runs below the square curve's
    efficiency (split-K and its reduce on the tall one), which the cost model reads as a ratio by aspect."""
    k = max(64, sizes.gemm_k // ASPECT)
    return [{"k": kk, "n": nn, "points": measure_small_m(device, dtype, sizes, progress, kk, n=nn)}
            for kk, nn in ((k, ASPECT * k), (ASPECT * k, k))]
