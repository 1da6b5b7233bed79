"""Paged decode attention on the GPU: the old launch (16 splits, one 16-token page per loop step) against the
new defaults and a small sweep, at the Qwen3-0.6B shape (16 query / 8 KV heads of 128, bf16, page 16).

    python scripts/gpu_attn_decode.py                 # the H200 run: writes $OUT/attn_decode_h200.json
    python scripts/gpu_attn_decode.py --variants old new
    TRITON_INTERPRET=1 python scripts/gpu_attn_decode.py --tiny   # CPU smoke run at toy sizes

The kernels are the generated ones (codegen/kernels/attention.py renders them from the template), launched
as the host program launches them: split kernel, then the reduce where there is more than one split. Each
timed call reads a different copy of the cache (as 28 layers do) so small KV sets do not sit in L2; times are
CUDA-graph replays of 20 calls, the best of 5 replays, in us per call (split + reduce). GB/s is the KV bytes
read (batch x (context + 1) x 8 heads x (K + V) x 128 x 2 B) per call time. Every output is checked against
torch SDPA on a dense copy of the same KV (fp32 math), and SDPA on the dense bf16 copy is timed as a yardstick.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _bootstrap import bootstrap  # noqa: E402

bootstrap()

import torch  # noqa: E402

TINY = False
CALLS, REPLAYS = 20, 5


def decode_kernels(hq: int, hkv: int, d: int, dtype: str, cfg: dict, compute_units: int, tmp: Path):
    """(split kernel, reduce kernel, constexprs) generated for one attention shape under launch ``cfg``."""
    from portlayer.codegen.kernels.attention import build_decode
    from portlayer.codegen.kernels.context import GenContext
    from portlayer.flatten.ir import GraphBuilder, TensorType

    b = GraphBuilder()
    q = b.add_input("q", TensorType(dtype, ("num_tokens", hq, d)))
    k = b.add_input("k", TensorType(dtype, ("num_tokens", hkv, d)))
    v = b.add_input("v", TensorType(dtype, ("num_tokens", hkv, d)))
    b.graph.outputs = [b.add1("attention", [q, k, v], {"num_heads": hq, "num_kv_heads": hkv, "head_dim": d})]
    ctx = GenContext(b.graph, {"attention_decode": cfg}, compute_units=compute_units)
    spec, red, const, _, _ = build_decode(ctx, b.graph.nodes[-1])
    path = tmp / f"{spec.name}.py"
    path.write_text(spec.source)
    mod_spec = importlib.util.spec_from_file_location(spec.name, path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return getattr(mod, spec.fn), getattr(mod, red.fn), const


class Case:
    """One (batch, context) problem: ``copies`` paged caches with shuffled block tables and their dense twins."""

    def __init__(self, batch: int, context: int, hq: int, hkv: int, d: int, page: int, dtype, dev: str,
                 copies: int) -> None:
        g = torch.Generator().manual_seed(batch * 7919 + context)
        self.batch, self.context, self.hq, self.hkv, self.d, self.page = batch, context, hq, hkv, d, page
        n = context + 1  # the cached tokens and the new one
        per = -(-n // page)
        self.seq_lens = torch.full((batch,), n, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        self.q = torch.randn(batch, hq, d, generator=g).to(dtype).to(dev)
        self.caches, self.tables, self.dense = [], [], []
        for _ in range(copies):
            kc = torch.randn(batch * per + 1, page, hkv, d, generator=g).to(dtype).to(dev)
            vc = torch.randn(batch * per + 1, page, hkv, d, generator=g).to(dtype).to(dev)
            bt = (torch.randperm(batch * per, generator=g) + 1).to(torch.int32).view(batch, per).to(dev)
            self.caches.append((kc, vc))
            self.tables.append(bt)
            rows = bt.long()
            kd = kc[rows].reshape(batch, per * page, hkv, d)[:, :n].transpose(1, 2).contiguous()
            vd = vc[rows].reshape(batch, per * page, hkv, d)[:, :n].transpose(1, 2).contiguous()
            self.dense.append((kd, vd))
        self.kv_bytes = batch * n * hkv * 2 * d * torch.empty(0, dtype=dtype).element_size()
        self.scale = 1.0 / math.sqrt(d)
        self.out = torch.empty(batch, hq, d, dtype=dtype, device=dev)

    def reference(self, c: int = 0) -> torch.Tensor:
        kd, vd = self.dense[c]
        o = torch.nn.functional.scaled_dot_product_attention(self.q.float()[:, :, None], kd.float(), vd.float(),
                                                             scale=self.scale, enable_gqa=True)
        return o[:, :, 0]

    def sdpa(self, c: int) -> None:
        kd, vd = self.dense[c]
        torch.nn.functional.scaled_dot_product_attention(self.q[:, :, None], kd, vd, scale=self.scale, enable_gqa=True)


class Launcher:
    """The host program's decode launches for one kernel config and a fixed split count."""

    def __init__(self, case: Case, dec, red, const: dict, cfg: dict, splits: int) -> None:
        self.c, self.dec, self.red, self.const, self.cfg, self.splits = case, dec, red, const, cfg, splits
        rows = case.batch * case.hq * const["MAX_SPLITS"]
        dev = case.q.device
        self.part_out = torch.empty(rows * const["BLOCK_D"], dtype=torch.float32, device=dev)
        self.part_max = torch.empty(rows, dtype=torch.float32, device=dev)
        self.part_sum = torch.empty(rows, dtype=torch.float32, device=dev)

    def __call__(self, copy: int = 0) -> None:
        c, const, sp = self.c, self.const, self.splits
        kc, vc = c.caches[copy]
        bt = c.tables[copy]
        self.dec[(c.batch, c.hkv, sp)](
            c.q, kc, vc, bt, c.seq_lens, c.qsl, self.part_out, self.part_max, self.part_sum, c.out, 0, bt.stride(0),
            sp, c.scale, **{k: v for k, v in const.items() if k != "BLOCK_SIZE"}, BLOCK_SIZE=c.page,
            num_warps=self.cfg["num_warps"], num_stages=self.cfg["num_stages"])
        if sp > 1:
            self.red[(c.batch, c.hq)](
                self.part_out, self.part_max, self.part_sum, c.qsl, c.out, 0, sp, HQ=const["HQ"], D=const["D"],
                BLOCK_D=const["BLOCK_D"], MAX_SPLITS=const["MAX_SPLITS"], num_warps=self.cfg["num_warps"])


class Runner:
    """Checks and times one launch config on one case; each result becomes a row (printed as it comes)."""

    def __init__(self, case: Case, ref: torch.Tensor, copies: int, kern, rows: list, cuda: bool) -> None:
        self.case, self.ref, self.copies, self.kern, self.rows, self.cuda = case, ref, copies, kern, rows, cuda

    def __call__(self, label: str, cfg: dict, splits: int) -> dict:
        case = self.case
        row = {"batch": case.batch, "context": case.context, "variant": label, "BLOCK_N": cfg["BLOCK_N"],
               "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "splits": splits,
               "kv_bytes": case.kv_bytes}
        try:
            dec, red, const = self.kern(cfg)
            row["BLOCK_N"] = const["BLOCK_N"]
            launch = Launcher(case, dec, red, const, cfg, splits)
            case.out.zero_()
            launch(0)
            if self.cuda:
                torch.cuda.synchronize()
            row["max_abs_err"] = float((case.out.float() - self.ref).abs().max())
            us = time_us(launch, self.copies)
            row.update(us=round(us, 2), gbps=round(case.kv_bytes / us / 1e3, 1))
        except Exception as e:  # a config that does not compile here (shared memory) is a row, not a crash
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        self.rows.append(row)
        print(f"b={case.batch:<3} ctx={case.context:<5} {label:<7} BLOCK_N={row['BLOCK_N']:<4} w={cfg['num_warps']} "
              f"s={cfg['num_stages']} splits={splits:<3} "
              + (f"{row['us']:>9.2f} us {row['gbps']:>8.1f} GB/s err {row['max_abs_err']:.2e}"
                 if "us" in row else row["error"]), flush=True)
        return row


def time_us(fn, copies: int) -> float:
    """us per call: a CUDA graph of CALLS calls (each on the next cache copy), the best of REPLAYS replays."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn(0)
        return (time.perf_counter() - t0) * 1e6
    for i in range(copies):  # warm: compiles outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / CALLS)
    del graph
    return best


def default_cfg(descriptor: str) -> dict:
    """The Plan's attention_decode launch config for Qwen3-0.6B on ``descriptor`` (policy + descriptor)."""
    from portlayer.capabilities.policy import ModelRequirements, negotiate

    cfg = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
           "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
           "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": True,
           "torch_dtype": "bfloat16"}
    return negotiate(ModelRequirements.from_hf_config(cfg, name="Qwen3-0.6B"), descriptor).launch_config(
        "attention_decode")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy sizes for a CPU run under TRITON_INTERPRET=1")
    ap.add_argument("--variants", nargs="+", default=["old", "new", "sweep", "splits", "sdpa"],
                    choices=["old", "new", "sweep", "splits", "sdpa"])
    ap.add_argument("--shapes", nargs="+", default=None, metavar="BxCTX", help="e.g. 64x512 1x2048 (default: six)")
    ap.add_argument("--descriptor", default="nvidia-h200")
    ap.add_argument("--deadline-s", type=float, default=170.0, help="no new shape is started after this many seconds (the run stays under 4 minutes)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from portlayer.capabilities.descriptor import load_descriptor
    from portlayer.codegen.kernels.attention import decode_splits

    start = time.monotonic()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    desc = load_descriptor(args.descriptor)
    cu = int(desc.compute_units.count)
    if args.tiny:
        hq, hkv, d, dtype, dt = 4, 2, 32, "float32", torch.float32
        shapes = [(1, 40), (3, 70)]
        sweep = [(bn, w, s) for bn in (16, 32) for w in (2,) for s in (1,)]
    else:
        hq, hkv, d, dtype, dt = 16, 8, 128, "bfloat16", torch.bfloat16
        # the case first; batch 16 (3 splits: kernels of its own to compile) last
        shapes = [(64, 512), (1, 512), (64, 2048), (1, 2048), (16, 512), (16, 2048)]
        sweep = [(bn, w, s) for bn in (16, 32, 64, 128) for w in (2, 4) for s in (1, 2, 3)]
    if args.shapes:
        shapes = [tuple(int(x) for x in t.lower().split("x")) for t in args.shapes]
    page = 16
    new = dict(default_cfg(args.descriptor))
    old = {**new, "BLOCK_N": page, "num_warps": 2, "num_stages": 2}  # the session-6 kernel: a page per step
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu (interpreter)'}; {cu} compute units; "
          f"new defaults {new}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="attn-decode-"))
    kernels: dict[tuple, tuple] = {}

    def kern(cfg: dict):
        key = (cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"])
        if key not in kernels:
            kernels[key] = decode_kernels(hq, hkv, d, dtype, cfg, cu, tmp)
        return kernels[key]

    rows, summary = [], []
    for batch, context in shapes:
        if time.monotonic() - start > args.deadline_s:
            print(f"deadline: skipping b={batch} ctx={context}", flush=True)
            continue
        case0 = Case(batch, context, hq, hkv, d, page, dt, dev, 1)
        copies = 1 if not cuda else max(1, min(28, -(-(256 << 20) // case0.kv_bytes)))
        case = case0 if copies == 1 else Case(batch, context, hq, hkv, d, page, dt, dev, copies)
        del case0
        ref = case.reference(0)
        rule = decode_splits(batch, hkv, cu, kern(new)[2]["MAX_SPLITS"])

        run = Runner(case, ref, copies, kern, rows, cuda)

        got = {}
        if "old" in args.variants:
            got["old"] = run("old", old, kern(old)[2]["MAX_SPLITS"])
        if "new" in args.variants:
            got["new"] = run("new", new, rule)
        best = None
        if "sweep" in args.variants:
            for bn, w, s in sweep:
                if time.monotonic() - start > args.deadline_s + 40:
                    print(f"deadline: sweep cut short at b={batch} ctx={context}", flush=True)
                    break
                r = run("sweep", {**new, "BLOCK_N": bn, "num_warps": w, "num_stages": s}, rule)
                if "us" in r and (best is None or r["us"] < best["us"]):
                    best = r
        if "splits" in args.variants:
            base = best or got.get("new") or {"BLOCK_N": new["BLOCK_N"], "num_warps": new["num_warps"],
                                              "num_stages": new["num_stages"]}
            cfg = {**new, "BLOCK_N": base["BLOCK_N"], "num_warps": base["num_warps"], "num_stages": base["num_stages"]}
            for sp in (1, 2, 4, 8, 16):
                if sp <= kern(cfg)[2]["MAX_SPLITS"]:
                    r = run("splits", cfg, sp)
                    if "us" in r and (best is None or r["us"] < best["us"]):
                        best = r
        if "sdpa" in args.variants:
            row = {"batch": batch, "context": context, "variant": "sdpa", "kv_bytes": case.kv_bytes}
            try:
                us = time_us(case.sdpa, copies)
                row.update(us=round(us, 2), gbps=round(case.kv_bytes / us / 1e3, 1))
                print(f"b={batch:<3} ctx={context:<5} sdpa (dense bf16 copy) {us:>9.2f} us {row['gbps']:>8.1f} GB/s",
                      flush=True)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            got["sdpa"] = row
        s = {"batch": batch, "context": context, "rule_splits": rule, "copies": copies}
        for k, r in got.items():
            s[f"{k}_us"] = r.get("us")
        if best is not None:
            s["best"] = {k: best[k] for k in ("BLOCK_N", "num_warps", "num_stages", "splits", "us", "gbps")}
        if s.get("old_us") and s.get("new_us"):
            s["speedup_new_vs_old"] = round(s["old_us"] / s["new_us"], 2)
            s["step_ms_28_layers_old_new"] = [round(28 * s["old_us"] / 1e3, 3), round(28 * s["new_us"] / 1e3, 3)]
        summary.append(s)
        del case, run
        if cuda:
            torch.cuda.empty_cache()
    errs = [r["max_abs_err"] for r in rows if "max_abs_err" in r]
    worst = max(errs) if errs else None
    tol = 1e-3 if args.tiny else 3e-2
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu-interpreter", "torch": torch.__version__,
              "triton": __import__("triton").__version__, "descriptor": args.descriptor, "compute_units": cu,
              "shape": {"hq": hq, "hkv": hkv, "head_dim": d, "dtype": dtype, "page": page}, "new_defaults": new,
              "old": old, "worst_abs_err": worst, "tolerance": tol, "all_within_tolerance": worst is not None and worst <= tol,
              "seconds": round(time.monotonic() - start, 1), "summary": summary, "rows": rows}
    out = args.out or Path(os.environ.get("OUT") or ".") / "attn_decode_h200.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"worst max abs err vs SDPA: {worst} (tolerance {tol}); {result['seconds']} s; wrote {out}", flush=True)
    return 0 if result["all_within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
