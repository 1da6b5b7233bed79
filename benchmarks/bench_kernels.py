"""Per-kernel time of the generated Triton kernels against torch eager for the same op,
at Qwen3-0.6B shapes in bf16 on the current GPU; prints a table and writes JSON.

    python benchmarks/bench_kernels.py --out bench_kernels.json

Each case is a one-op (or one fused group) Flat IR graph run through a generated program
(``forward`` on preallocated buffers) versus the op's reference implementation (torch eager,
a new tensor per call, as an eager model does). GEMM rows also give the Triton-vs-torch.mm
crossover that codegen/gemm_rule.py encodes. Times are medians of triton.testing.do_bench.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bootstrap import bootstrap  # noqa: E402

bootstrap()

import os  # noqa: E402

import torch  # noqa: E402

DRY = os.environ.get("PORTLAYER_BENCH_DRY") == "1"  # CPU + interpreter smoke run at toy sizes
DEV = "cpu" if DRY else "cuda"
H, I, HQ, HKV, D, V = (64, 96, 4, 2, 32, 300) if DRY else (1024, 3072, 16, 8, 128, 151936)  # noqa: E741
DT = "float32" if DRY else "bfloat16"
DT_T = torch.float32 if DRY else torch.bfloat16


def _program(graph, groups=None, gemm_tokens: int = 0):
    from portlayer.capabilities.descriptor import load_descriptor
    from portlayer.codegen.host import generate_triton_program
    from portlayer.codegen.kernels.context import GenContext
    from portlayer.codegen.program import load_program, write_program

    desc = load_descriptor("nvidia-h200")
    launch = {  # the H200 Plan's configs at this model's shape (capabilities/policy.py)
        "gemm": {"num_warps": 8, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 4},
        "attention_decode": {"num_warps": 4, "BLOCK_H": 16, "BLOCK_N": 16, "BLOCK_D": 128, "num_stages": 3},
        "attention_prefill": {"num_warps": 8, "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": 128, "num_stages": 2},
    }
    if groups is not None:
        graph.meta["kernels"] = groups
    ctx = GenContext(graph, launch, warp_size=desc.warp_size, compute_units=desc.compute_units.count,
                     triton_gemm_max_tokens=gemm_tokens)
    out = Path(tempfile.mkdtemp(prefix="bench-"))
    write_program(generate_triton_program(graph, ctx, target=desc.name), out)
    return load_program(out, graph.weights, DEV, max_tokens=4096, max_seqs=64)


def _time(fn) -> float:
    if DRY:
        import time

        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median")) * 1e3  # microseconds


def _case(name, graph, feeds, groups=None, meta=None, caches=None, gemm_tokens=0, torch_fn=None):
    from portlayer.codegen.host_support import StepState
    from portlayer.runtime.executable import ReferenceExecutable

    prog = _program(graph, groups, gemm_tokens)
    feeds = {k: v.to(DEV) for k, v in feeds.items()}
    T = int(next(iter(feeds.values())).shape[0])  # noqa: N806
    st = StepState.build(meta, T, torch.device(DEV), caches)
    ref = ReferenceExecutable(graph, DEV)
    ours = _time(lambda: prog.forward(T, st.num_seqs, feeds, st, caches))
    eager = _time(torch_fn or (lambda: ref.run(feeds, meta, caches)))
    row = {"case": name, "tokens": T, "triton_us": round(ours, 2), "torch_us": round(eager, 2),
           "speedup": round(eager / ours, 2)}
    print(f"{name:<42} {T:>6} {ours:>10.1f} {eager:>10.1f} {eager / ours:>7.2f}x", flush=True)
    return row


def _builder():
    from portlayer.flatten.ir import GraphBuilder

    return GraphBuilder()


def _t(*shape):
    from portlayer.flatten.ir import TensorType

    return TensorType(DT, ("num_tokens", *shape))


def pointwise_cases(rows):
    for t in (1, 64, 2048):
        b = _builder()
        g, u = b.add_input("g", _t(I)), b.add_input("u", _t(I))
        b.graph.outputs = [b.add1("mul", [b.add1("silu", [g]), u])]
        rows.append(_case("silu*mul [T,3072]", b.graph, {"g": torch.randn(t, I).to(DT_T), "u": torch.randn(t, I).to(DT_T)}))


def norm_cases(rows):
    from portlayer.codegen.groups import group_record

    for t in (1, 64, 2048):
        b = _builder()
        x, r = b.add_input("x", _t(H)), b.add_input("r", _t(H))
        w = b.add_param("w", torch.randn(H).to(DT_T))
        s = b.add1("add", [x, r])
        b.graph.outputs = [b.add1("rms_norm", [s, w], {"eps": 1e-6}), s]
        groups = [group_record(b.graph, [n.name for n in b.graph.nodes], "reduction")]
        rows.append(_case("add+rms_norm [T,1024]", b.graph, {"x": torch.randn(t, H).to(DT_T),
                                                             "r": torch.randn(t, H).to(DT_T)}, groups))
        b = _builder()
        x = b.add_input("x", _t(HQ, D))
        b.graph.outputs = [b.add1("rms_norm", [x, b.add_param("w", torch.randn(D).to(DT_T))], {"eps": 1e-6})]
        rows.append(_case("q_norm rms_norm [T,16,128]", b.graph, {"x": torch.randn(t, HQ, D).to(DT_T)}))


def rope_cases(rows):
    from portlayer.codegen.groups import group_record

    inv = 1.0 / 1e6 ** (torch.arange(0, D, 2).float() / D)
    f = torch.arange(4096).float()[:, None] * inv[None]
    for t in (1, 64, 2048):
        b = _builder()
        q, k = b.add_input("q", _t(HQ, D)), b.add_input("k", _t(HKV, D))
        from portlayer.flatten.ir import TensorType

        pos = b.add_input("positions", TensorType("int64", ("num_tokens",)))
        cache = b.add_param("cache", torch.cat([f.cos(), f.sin()], -1))
        a = {"style": "neox", "rotary_dim": D, "head_dim": D}
        b.graph.outputs = [b.add1("rope", [q, pos, cache], a), b.add1("rope", [k, pos, cache], a)]
        groups = [group_record(b.graph, [n.name for n in b.graph.nodes], "rope")]
        feeds = {"q": torch.randn(t, HQ, D).to(DT_T), "k": torch.randn(t, HKV, D).to(DT_T),
                 "positions": torch.randint(0, 4096, (t,))}
        rows.append(_case("rope q+k [T,16|8,128]", b.graph, feeds, groups))


def embedding_cases(rows):
    from portlayer.flatten.ir import TensorType

    for t in (1, 2048):
        b = _builder()
        ids = b.add_input("ids", TensorType("int64", ("num_tokens",)))
        b.graph.outputs = [b.add1("embedding", [b.add_param("w", torch.randn(V, H).to(DT_T)), ids])]
        rows.append(_case("embedding [151936,1024]", b.graph, {"ids": torch.randint(0, V, (t,))}))


def gemm_cases(rows):
    for n, k, label in ((2048, H, "q_proj"), (3072, H, "gate_proj"), (H, I, "down_proj"), (V, H, "lm_head")):
        for t in (1, 16, 64, 256, 2048):
            b = _builder()
            x = b.add_input("x", _t(k))
            b.graph.outputs = [b.add1("linear", [x, b.add_param("w", (torch.randn(n, k) / k**0.5).to(DT_T))])]
            feeds = {"x": torch.randn(t, k).to(DT_T)}
            row = _case(f"gemm {label} [T,{k}]x[{n},{k}]^T triton|mm", b.graph, feeds, gemm_tokens=1 << 30)
            vendor = _program(b.graph, None, 0)
            from portlayer.codegen.host_support import StepState

            st = StepState.build(None, t, torch.device(DEV), None)
            fc = {kk: v.to(DEV) for kk, v in feeds.items()}
            row["torch_us"] = round(_time(lambda vendor=vendor, st=st, fc=fc, t=t: vendor.forward(t, 1, fc, st, None)), 2)
            row["speedup"] = round(row["torch_us"] / row["triton_us"], 2)
            print(f"{'  (torch.mm into the same buffer)':<42} {t:>6} {row['triton_us']:>10.1f} {row['torch_us']:>10.1f} "
                  f"{row['speedup']:>7.2f}x", flush=True)
            rows.append(row)


def attention_cases(rows):
    from portlayer.flatten.ir import TensorType
    from portlayer.flatten.op_defs.attention import AttentionMetadata

    for batch, ctx, new in ((1, 1024, 1), (16, 1024, 1), (64, 1024, 1), (1, 0, 1024)):
        b = _builder()
        q = b.add_input("q", TensorType(DT, ("num_tokens", HQ, D)))
        k = b.add_input("k", TensorType(DT, ("num_tokens", HKV, D)))
        v = b.add_input("v", TensorType(DT, ("num_tokens", HKV, D)))
        b.graph.outputs = [b.add1("attention", [q, k, v], {"num_heads": HQ, "num_kv_heads": HKV, "head_dim": D})]
        per = -(-(ctx + new) // 16)
        caches = [(torch.randn(batch * per, 16, HKV, D, device=DEV).to(DT_T),
                   torch.randn(batch * per, 16, HKV, D, device=DEV).to(DT_T))]
        t = batch * new
        slots = [i * per * 16 + p for i in range(batch) for p in range(ctx, ctx + new)]
        meta = AttentionMetadata(
            torch.arange(0, t + 1, new, dtype=torch.int32, device=DEV),
            torch.full((batch,), ctx + new, dtype=torch.int32, device=DEV),
            torch.tensor(slots, device=DEV),
            torch.arange(batch * per, dtype=torch.int32, device=DEV).view(batch, per),
            batch if new > 1 else 0, new, ctx + new)
        feeds = {"q": torch.randn(t, HQ, D).to(DT_T), "k": torch.randn(t, HKV, D).to(DT_T),
                 "v": torch.randn(t, HKV, D).to(DT_T)}
        label = f"paged decode b={batch} ctx={ctx}" if new == 1 else f"paged prefill {new} tokens"
        torch_fn = None
        if new > 1:  # torch's best eager kernel for the same math: SDPA (flash) on dense tensors
            qd, kd, vd = (feeds[x].to(DEV).transpose(0, 1)[None] for x in "qkv")
            torch_fn = lambda qd=qd, kd=kd, vd=vd: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                qd, kd, vd, is_causal=True, enable_gqa=True)
            label += " (torch: SDPA)"
        else:
            label += " (torch: reference op)"
        rows.append(_case(label, b.graph, feeds, meta=meta, caches=caches, torch_fn=torch_fn))


def run_all(out: Path | None = None) -> list[dict]:
    print(f"{'case':<42} {'tokens':>6} {'triton us':>10} {'torch us':>10} {'speedup':>8}", flush=True)
    rows: list[dict] = []
    for fn in (pointwise_cases, norm_cases, rope_cases, embedding_cases, attention_cases, gemm_cases):
        try:
            fn(rows)
        except Exception as e:  # one broken family must not hide the others
            import traceback

            traceback.print_exc()
            rows.append({"case": fn.__name__, "error": f"{type(e).__name__}: {e}"})
    result = {"gpu": "dry-run" if DRY else torch.cuda.get_device_name(), "dtype": DT, "rows": rows}
    if out:
        Path(out).write_text(json.dumps(result, indent=1))
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_kernels.json"))
    run_all(ap.parse_args().out)
