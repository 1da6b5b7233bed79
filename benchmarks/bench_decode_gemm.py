"""Decode GEMMs at Qwen3-0.6B shapes: the generated programs' kernels against torch.mm, per row count.

For each weight shape (q 2048x1024, gate 3072x1024, down 1024x3072, lm_head 151936x1024) and each
format (bf16; weight-only int8 per channel; int4 g128), a one-linear Flat IR graph goes through the
pipeline for ``--target`` and its generated program runs at M rows; ``gemv_max_tokens`` is forced to
cover every M so the few-rows kernel is what is timed (the tensor-core kernel above it would not
be). Also timed: torch.mm on the bf16 weight (cuBLAS). Medians of triton.testing.do_bench_cudagraph
(the kernel replayed from a CUDA graph, as decode runs it), with the bandwidth the weight bytes imply. Prints a table, writes JSON.

    python benchmarks/bench_decode_gemm.py --rows 1,2,4,8,16 --json out.json
    PORTLAYER_BENCH_DRY=1 TRITON_INTERPRET=1 python benchmarks/bench_decode_gemm.py  # CPU smoke at toy sizes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bootstrap import bootstrap  # noqa: E402

bootstrap()

import torch  # noqa: E402

DRY = os.environ.get("PORTLAYER_BENCH_DRY") == "1"
SHAPES = ({"q": (64, 32)} if DRY else
          {"q": (2048, 1024), "gate": (3072, 1024), "down": (1024, 3072), "lm_head": (151936, 1024)})


def _graph(fmt: str, n: int, k: int, dtype: torch.dtype):
    from portlayer.flatten.ir import GraphBuilder, TensorType

    g = torch.Generator().manual_seed(n + k)
    b = GraphBuilder()
    x = b.add_input("x", TensorType(str(dtype).replace("torch.", ""), ("num_tokens", k)))
    if fmt == "bf16":
        b.graph.outputs = [b.add1("linear", [x, b.add_param("w", (torch.randn(n, k, generator=g) / k**0.5).to(dtype))])]
        return b.graph
    bits, group = (8, k) if fmt == "int8" else (4, 128 if k % 128 == 0 else 32)
    lo, hi = (-128, 128) if bits == 8 else (-8, 8)
    q = torch.randint(lo, hi, (n, k), generator=g)
    if bits == 4:
        u = (q + 8).to(torch.int32)
        q = (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8)
    else:
        q = q.to(torch.int8)
    s = (torch.rand(n, k // group, generator=g) * 0.01).to(dtype)
    ins = [x, b.add_param("qw", q), b.add_param("scales", s), None]
    b.graph.outputs = [b.add1("linear_wq", ins, {"bits": bits, "group_size": group})]
    return b.graph


def _program(graph, target: str, max_rows: int, tmp: Path):
    from portlayer.backends.generate import generate
    from portlayer.codegen.program import load_program, write_program
    from portlayer.passes.pipeline import run_pipeline

    dt = next(iter(graph.inputs)).type.dtype
    res = run_pipeline(graph, target, overrides={"compute_dtype": dt, "weight_quantization": "none"})
    gen = generate(res.graph, res.plan, res.descriptor, gemv_max_tokens=max_rows)
    write_program(gen, tmp)
    return load_program(tmp, res.graph.weights, "cpu" if DRY else "cuda", max_seqs=max_rows, use_graphs=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4" if DRY else "1,2,4,8,16")
    ap.add_argument("--target", default="nvidia-h200")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import triton.testing

    rows = [int(r) for r in args.rows.split(",")]
    dtype = torch.float32 if DRY else torch.bfloat16
    dev = "cpu" if DRY else "cuda"
    from portlayer.codegen.host_support import StepState

    # the kernels alone: replayed from a CUDA graph, so no Python launch cost is in the figure
    timer = (lambda f: triton.testing.do_bench_cudagraph(f, rep=20)) if not DRY else (lambda f: (f(), 0.0)[1])
    out = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=dtype, device=dev)
        for fmt in ("bf16", "int8", "int4"):
            with tempfile.TemporaryDirectory() as tmp:
                prog = _program(_graph(fmt, n, k, dtype), args.target, max(rows), Path(tmp))
                for m in rows:
                    x = torch.randn(m, k, dtype=dtype, device=dev)
                    st = StepState.build(None, m, torch.device(dev), None)
                    prog.forward(m, m, {"x": x}, st, None)  # compile outside the capture
                    ms = timer(lambda prog=prog, m=m, x=x, st=st: prog.forward(m, m, {"x": x}, st, None))
                    wbytes = n * k * (2 if fmt == "bf16" else 1 if fmt == "int8" else 0.5)
                    row = {"weight": name, "n": n, "k": k, "format": fmt, "rows": m, "ms": round(ms, 4),
                           "gbps": round(wbytes / ms / 1e6, 1) if ms else None}
                    if fmt == "bf16":
                        row["torch_mm_ms"] = round(timer(lambda x=x, w=w: torch.mm(x, w.T)), 4)
                    out.append(row)
                    print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name() if not DRY else "cpu",
                                               "rows": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
