"""The design sweep behind launch.gemv_wq (docs/performance.md, session 15): int4 few-rows GEMV at one row on the
Qwen3-0.6B projection shapes, hand-written candidate layouts of the K loop against bf16 torch.mm and, optionally,
a generated kernel (the whole-K form, e.g. an artifact's kernels/gemv_w4a_bf16_*.py with a tile-spanning group).

v2: in-group K tiles (BLOCK_K <= G), unrolled; v3: any K tile, every element gathers its group's scale; v5: the
sub-group form codegen ships ([BLOCK_N, BLOCK_K // SUB, SUB // 2] bytes, one scale per sub-group, broadcast).
Each launch reads another copy of the weight (copies cycled past L2); us per launch inside a replayed CUDA graph.

    python scripts/gpu_int4_gemv_sweep.py OUT.json [--current KERNEL.py] [--quick]
"""
import json
import math
import os
import sys
import time

import torch
import triton
import triton.language as tl


def load_current(argv: list[str]):
    """The generated kernel named by --current (its function is the file's name), or None."""
    if "--current" not in argv:
        return None
    import importlib.util

    path = argv[argv.index("--current") + 1]
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, os.path.basename(path)[:-3])


@triton.jit
def w4_v2(a_ptr, q_ptr, s_ptr, o_ptr, c_ptr, M, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACC3: tl.constexpr,
          UNROLL: tl.constexpr):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    mmask = rm < M
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    j = tl.arange(0, BLOCK_K // 2)
    if ACC3:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k00 in range(0, K, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):
            k0 = k00 + u * BLOCK_K
            kk = k0 + 2 * j
            kmask = kk < K
            amask = mmask[:, None] & kmask[None, :]
            aoff = rm[:, None].to(tl.int64) * K + kk[None, :]
            ae = tl.load(a_ptr + aoff, mask=amask, other=0.0).to(tl.float32)
            ao = tl.load(a_ptr + aoff + 1, mask=amask, other=0.0).to(tl.float32)
            packed = tl.load(q_ptr + rn[:, None].to(tl.int64) * (K // 2) + (k0 // 2 + j)[None, :],
                             mask=nmask[:, None] & kmask[None, :], other=0).to(tl.int32)
            g = k0 // G
            s = tl.load(s_ptr + rn * (K // G) + g, mask=nmask, other=0.0).to(tl.float32)
            z = tl.load(o_ptr + rn * (K // G) + g, mask=nmask, other=0.0).to(tl.float32) - 8.0 * s
            lo = (packed & 15).to(tl.float32)
            hi = (packed >> 4).to(tl.float32)
            if ACC3:
                wl = lo * s[:, None] + z[:, None]
                wh = hi * s[:, None] + z[:, None]
                acc3 += ae[:, None, :] * wl[None, :, :] + ao[:, None, :] * wh[None, :, :]
            else:
                raw = tl.sum(ae[:, None, :] * lo[None, :, :] + ao[:, None, :] * hi[None, :, :], axis=2)
                asum = tl.sum(ae + ao, axis=1)
                acc += raw * s[None, :] + asum[:, None] * z[None, :]
    if ACC3:
        acc = tl.sum(acc3, axis=2)
    cmask = mmask[:, None] & nmask[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=cmask)


@triton.jit
def w4_v3(a_ptr, q_ptr, s_ptr, o_ptr, c_ptr, M, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr):
    """Any K tile: every element gathers its group's scale and offset (cache hits), one reduction at the end."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    mmask = rm < M
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    j = tl.arange(0, BLOCK_K // 2)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    for k00 in range(0, K, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):
            k0 = k00 + u * BLOCK_K
            kk = k0 + 2 * j
            kmask = kk < K
            amask = mmask[:, None] & kmask[None, :]
            aoff = rm[:, None].to(tl.int64) * K + kk[None, :]
            ae = tl.load(a_ptr + aoff, mask=amask, other=0.0).to(tl.float32)
            ao = tl.load(a_ptr + aoff + 1, mask=amask, other=0.0).to(tl.float32)
            wmask = nmask[:, None] & kmask[None, :]
            packed = tl.load(q_ptr + rn[:, None].to(tl.int64) * (K // 2) + (k0 // 2 + j)[None, :],
                             mask=wmask, other=0).to(tl.int32)
            goffs = rn[:, None] * (K // G) + (kk // G)[None, :]
            s = tl.load(s_ptr + goffs, mask=wmask, other=0.0).to(tl.float32)
            z = tl.load(o_ptr + goffs, mask=wmask, other=0.0).to(tl.float32) - 8.0 * s
            wl = (packed & 15).to(tl.float32) * s + z
            wh = (packed >> 4).to(tl.float32) * s + z
            acc3 += ae[:, None, :] * wl[None, :, :] + ao[:, None, :] * wh[None, :, :]
    acc = tl.sum(acc3, axis=2)
    cmask = mmask[:, None] & nmask[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=cmask)


@triton.jit
def w4_v5(a_ptr, q_ptr, s_ptr, o_ptr, c_ptr, M, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
          UNROLL: tl.constexpr):
    """The W tile as [BLOCK_N, BLOCK_K // SUB, SUB // 2] bytes: one scale per (column, sub-group), broadcast."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rs = tl.arange(0, BLOCK_K // SUB)
    jj = tl.arange(0, SUB // 2)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K // SUB, SUB // 2), dtype=tl.float32)
    for k00 in range(0, K, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):
            k0 = k00 + u * BLOCK_K
            si = k0 // SUB + rs
            smask = si < K // SUB
            kk = (si * SUB)[:, None] + 2 * jj[None, :]
            ae = tl.load(a_ptr + kk, mask=smask[:, None], other=0.0).to(tl.float32)
            ao = tl.load(a_ptr + kk + 1, mask=smask[:, None], other=0.0).to(tl.float32)
            wmask = nmask[:, None, None] & smask[None, :, None]
            packed = tl.load(q_ptr + rn[:, None, None].to(tl.int64) * (K // 2) + (kk // 2)[None, :, :],
                             mask=wmask, other=0).to(tl.int32)
            goffs = rn[:, None] * (K // G) + (si * SUB // G)[None, :]
            gm = nmask[:, None] & smask[None, :]
            s = tl.load(s_ptr + goffs, mask=gm, other=0.0).to(tl.float32)
            z = tl.load(o_ptr + goffs, mask=gm, other=0.0).to(tl.float32) - 8.0 * s
            wl = (packed & 15).to(tl.float32) * s[:, :, None] + z[:, :, None]
            wh = (packed >> 4).to(tl.float32) * s[:, :, None] + z[:, :, None]
            acc3 += ae[None, :, :] * wl + ao[None, :, :] * wh
    acc = tl.sum(tl.sum(acc3, axis=2), axis=1)
    tl.store(c_ptr + rn, acc, mask=nmask)


SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gateup": (6144, 1024), "down": (1024, 3072)}
CUR = {"qkv": (8, 1024), "o": (2, 2048), "gateup": (16, 1024), "down": (2, 1024)}  # (BLOCK_N, BLOCK_K) main picks
G = 128


def make(n, k, copies, dev):
    qs = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev) for _ in range(copies)]
    ss = [(torch.rand(n, k // G, device=dev) * 0.02 + 0.001).to(torch.bfloat16) for _ in range(copies)]
    os_ = [(torch.randn(n, k // G, device=dev) * 0.01).to(torch.bfloat16) for _ in range(copies)]
    return qs, ss, os_


def deq(q, s, o):
    lo = (q & 15).float() - 8
    hi = (q >> 4).float() - 8
    w = torch.stack([lo, hi], dim=-1).reshape(q.shape[0], -1)
    n, k = w.shape
    return (w.view(n, k // G, G) * s.float()[:, :, None] + o.float()[:, :, None]).view(n, k)


def time_graph(fn, copies, reps=20):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(copies):
            fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1000 / (reps * copies)


def sweep_shape(name: str, n: int, k: int, configs: list, cur_kernel, dev: str) -> dict:
    """One projection shape: bf16 torch.mm, the --current kernel and every candidate config (us per launch)."""
    t0 = time.time()
    wbytes = n * k // 2 + 2 * 2 * n * k // G
    copies = max(8, math.ceil(240e6 / wbytes))
    qs, ss, os_ = make(n, k, copies, dev)
    a = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    ref = a.float() @ deq(qs[-1], ss[-1], os_[-1]).T  # the last launch's weight is what c holds
    c = torch.empty(1, n, device=dev, dtype=torch.float32)
    row = {}
    wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(max(8, math.ceil(240e6 / (2 * n * k))))]
    cb = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    row["bf16 torch.mm"] = {"us": time_graph(lambda i: torch.mm(a, wb[i].T, out=cb), len(wb))}
    bn, bk = CUR[name]

    def cur(i):
        cur_kernel[(triton.cdiv(n, bn),)](a, qs[i], ss[i], os_[i], c, 1, N=n, K=k, BLOCK_M=1, BLOCK_N=bn,
                                          BLOCK_K=bk, G=G, num_warps=4, num_stages=1)
    if cur_kernel is not None:
        us = time_graph(cur, copies)
        err = (c - ref).abs().max().item() / ref.abs().max().item()
        row["current"] = {"us": us, "err": err}
    for kern, bn2, bk2, w, acc3, unroll in configs:
        if bn2 * bk2 // 2 > 64 * 32 * w:  # > 64 fp32 accumulators a thread
            continue
        u = unroll or triton.cdiv(k, bk2)
        key = f"{kern} bn{bn2} bk{bk2} w{w} acc3{int(acc3)} u{unroll}"

        def launch(i, kern=kern, bn2=bn2, bk2=bk2, w=w, acc3=acc3, u=u):
            if kern == "v2":
                w4_v2[(triton.cdiv(n, bn2),)](a, qs[i], ss[i], os_[i], c, 1, N=n, K=k, G=G, BLOCK_M=1, BLOCK_N=bn2,
                                              BLOCK_K=bk2, ACC3=acc3, UNROLL=u, num_warps=w, num_stages=1)
            elif kern == "v5":
                w4_v5[(triton.cdiv(n, bn2),)](a, qs[i], ss[i], os_[i], c, 1, N=n, K=k, G=G, BLOCK_M=1, BLOCK_N=bn2,
                                              BLOCK_K=bk2, SUB=acc3, UNROLL=u, num_warps=w, num_stages=1)
            else:
                w4_v3[(triton.cdiv(n, bn2),)](a, qs[i], ss[i], os_[i], c, 1, N=n, K=k, G=G, BLOCK_M=1, BLOCK_N=bn2,
                                              BLOCK_K=bk2, UNROLL=u, num_warps=w, num_stages=1)
        try:
            us = time_graph(launch, copies)
        except Exception as e:  # noqa: BLE001
            row[key] = {"error": str(e)[:200]}
            continue
        err = (c - ref).abs().max().item() / ref.abs().max().item()
        row[key] = {"us": us, "err": err}
        print(f"  {name} {key}: {us:.2f} us err {err:.1e} (t+{time.time() - t0:.0f} s)", flush=True)
        if time.time() - t0 > 70:
            print("  shape budget spent", flush=True)
            break
    good = sorted((v["us"], key) for key, v in row.items() if "us" in v and v.get("err", 0) < 1e-3)
    cur_us = f"{row['current']['us']:.2f} us" if "current" in row else "-"
    print(f"{name} N={n} K={k} copies={copies} ({time.time() - t0:.0f} s): bf16 mm {row['bf16 torch.mm']['us']:.2f} us, "
          f"current {cur_us}", flush=True)
    for us, key in good[:12]:
        print(f"   {us:7.2f}  {key}", flush=True)
    bad = [key for key, v in row.items() if v.get("err", 0) >= 1e-3 or "error" in v]
    if bad:
        print("   wrong/failed:", bad[:6], flush=True)
    return row


def main():
    out_path = sys.argv[1]
    quick = "--quick" in sys.argv
    cur_kernel = load_current(sys.argv)
    dev = "cuda"
    torch.manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": {}}
    # (kernel, BLOCK_N, BLOCK_K, warps, acc3, unroll); unroll 0 = the whole K in one unrolled pass
    configs = [("v2", 2, 128, 4, True, 0), ("v3", 1, 1024, 4, True, 0)]
    configs += [("v5", bn, bk, w, 128, 0) for bn in (1, 2, 4) for bk in (256, 512, 1024) for w in (4, 8)]
    configs += [("v5", 2, 512, 4, 64, 0), ("v5", 1, 1024, 4, 64, 0), ("v5", 2, 512, 4, 128, 1), ("v5", 2, 512, 2, 128, 0)]
    if quick:
        configs = configs[::5]
    for name, (n, k) in SHAPES.items():
        res["rows"][name] = sweep_shape(name, n, k, configs, cur_kernel, dev)
        torch.cuda.empty_cache()
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
