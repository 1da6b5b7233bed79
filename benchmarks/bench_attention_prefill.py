"""Paged prefill attention on the GPU: the generated Triton kernel at several launch configs beside
``torch.nn.functional.scaled_dot_product_attention`` (flash) on the same shapes (issue 12 lever 5).

The kernel is rendered from codegen/templates/triton/attention_prefill.py.j2 exactly as codegen
renders it (paged, causal), its K/V read from a paged cache of 16-token blocks in a shuffled block
order; SDPA reads dense [B, H, L, D] tensors (its best case). Each config is checked against SDPA
(max abs error) before it is timed; CUDA events over ``--iters`` launches. Prints a table and writes
JSON (``--json``).

    python benchmarks/bench_attention_prefill.py --json docs/gpu-results/attention_prefill_h200.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bootstrap import bootstrap  # noqa: E402

bootstrap()


def load_kernel(tmp: Path):
    """The template as codegen renders it (a longest-blocks-first order was measured once, 2026-12-01: at most 5%)."""
    from portlayer.codegen.render import render

    src = render("triton/attention_prefill.py.j2", fn="attn_prefill_bench", doc="bench", paged=True, causal=True,
                 window=False, softcap=False, dot_args="", even_d=True, kv_upcast=None)
    path = tmp / "attn_prefill_bench.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.attn_prefill_bench


def setup(nseq: int, length: int, hq: int, hkv: int, d: int, dev: torch.device, block: int = 16):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(nseq * length, hq, d, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(nseq * length, hkv, d, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn(nseq * length, hkv, d, device=dev, generator=g, dtype=torch.bfloat16)
    nblk = -(-length // block)
    perm = torch.randperm(nseq * nblk, device=dev, generator=g).to(torch.int32)
    bt = perm.view(nseq, nblk)
    kc = torch.zeros(nseq * nblk, block, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    pos = torch.arange(length, device=dev)
    for s in range(nseq):
        slots = bt[s, pos // block].long() * block + pos % block
        kc.view(-1, hkv, d)[slots] = k[s * length:(s + 1) * length]
        vc.view(-1, hkv, d)[slots] = v[s * length:(s + 1) * length]
    qsl = (torch.arange(nseq + 1, device=dev) * length).to(torch.int32)
    lens = torch.full((nseq,), length, device=dev, dtype=torch.int32)
    return q, k, v, kc, vc, bt, qsl, lens


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="2x1024,16x1024", help="NSEQxLEN prefills")
    p.add_argument("--heads", default="16,8,128", help="HQ,HKV,D (Qwen3-0.6B)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch.nn.functional as F  # noqa: N812
    import triton

    dev = torch.device("cuda")
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="bench-attn-"))
    kernel = load_kernel(tmp)
    rows = []
    for shape in args.shapes.split(","):
        nseq, length = (int(x) for x in shape.split("x"))
        q, k, v, kc, vc, bt, qsl, lens = setup(nseq, length, hq, hkv, d, dev)
        qd, kd, vd = (t.view(nseq, length, -1, d).transpose(1, 2) for t in (q, k, v))
        flops = 4 * nseq * hq * d * length * (length + 1) / 2
        ref = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
        sdpa_ms = timed(functools.partial(F.scaled_dot_product_attention, qd, kd, vd, is_causal=True, enable_gqa=True),
                        args.iters)
        rows.append({"shape": shape, "impl": "sdpa", "ms": round(sdpa_ms, 4), "tflops": round(flops / sdpa_ms / 1e9, 1)})
        print(f"{shape:>9} sdpa {sdpa_ms:8.3f} ms {flops / sdpa_ms / 1e9:7.1f} TFLOP/s", flush=True)
        ref_tok = ref.transpose(1, 2).reshape(nseq * length, hq, d)
        out = torch.empty_like(q)
        for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
            grid = (nseq * length // bm + nseq, 1, hq)  # as codegen launches it: T // BLOCK_M + S programs a head
            go = functools.partial(kernel[grid], q, kc, vc, out, bt, lens, qsl, bt.stride(0), nseq, d ** -0.5, HQ=hq,
                                   HKV=hkv, D=d, GROUP=hq // hkv, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d, BLOCK_SIZE=16,
                                   WINDOW=0, SOFTCAP=0.0, num_warps=w, num_stages=st)
            try:
                go()
                torch.cuda.synchronize()
            except Exception as e:  # out of shared memory / registers for this config
                rows.append({"shape": shape, "impl": "triton", "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w,
                             "num_stages": st, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            err = float((out.float() - ref_tok.float()).abs().max())
            ms = timed(go, args.iters)
            rows.append({"shape": shape, "impl": "triton", "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w,
                         "num_stages": st, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                         "vs_sdpa": round(sdpa_ms / ms, 3), "max_abs_err": err})
        best = sorted((r for r in rows if r["shape"] == shape and r["impl"] == "triton" and "ms" in r),
                      key=lambda r: r["ms"])[:6]
        for r in best:
            print(f"{shape:>9} triton BM={r['BLOCK_M']} BN={r['BLOCK_N']} w={r['num_warps']} s={r['num_stages']}: "
                  f"{r['ms']:.3f} ms {r['tflops']} TFLOP/s ({r['vs_sdpa']}x sdpa) "
                  f"err {r['max_abs_err']:.2e}", flush=True)
    res = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
           "heads": [hq, hkv, d], "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
