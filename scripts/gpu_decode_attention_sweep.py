"""Time the generated paged decode attention (split-K kernel + its reduce, as a program step runs them) over batches
and contexts, for several launch.attention_decode configs: the measurement behind the Plan's default and the tuner's
candidates. Each config's program is generated for the descriptor, its kernels compiled ahead of time as an
artifact's are (PDL where the descriptor has it), and each (batch, context) point is a CUDA graph of R steps on R
distinct caches (at least 256 MB of KV together, so the reads come from HBM as a model's layers' do), replayed.

    python scripts/gpu_decode_attention_sweep.py out.json --configs '[{}, {"TILE": 4096}]'

``{}`` is the Plan's default; other entries are merged over it. Runs on any tree that has
backends/calibration_runner.one_attention (an older tree's kernels take the configs its Plan has).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _bootstrap import bootstrap  # noqa: E402

bootstrap()

import torch  # noqa: E402

from portlayer.flatten.op_defs.attention import AttentionMetadata  # noqa: E402


def build(cfg: dict, heads: tuple[int, int, int], target: str, out: Path, kv: str | None = None):
    from portlayer.backends.calibration_runner import one_attention, with_binaries
    from portlayer.backends.generate import generate
    from portlayer.backends.triton_program import load_program
    from portlayer.codegen.program import write_program
    from portlayer.passes.pipeline import run_pipeline

    overrides = {"compute_dtype": "bfloat16", "weight_quantization": "none"}
    if kv:
        overrides["kv_cache_dtype"] = kv
    res = run_pipeline(one_attention(heads, torch.bfloat16), target, overrides=overrides)
    launch = {**res.plan.value("launch.attention_decode"), **cfg}
    write_program(generate(res.graph, res.plan, res.descriptor, launch={"attention_decode": launch}), out)
    src = with_binaries(out, res.descriptor)
    prog = load_program(out, res.graph.weights, "cuda", res.plan, use_graphs=False, max_seqs=512, sources=src)
    return prog, launch


def case(batch: int, context: int, heads: tuple[int, int, int], copies: int, dev: torch.device,
         cache_dtype: torch.dtype = torch.bfloat16):
    hq, hkv, d = heads
    per = -(-(context + 1) // 16)
    g = torch.Generator(device=dev).manual_seed(0)
    caches = []
    for _ in range(copies):
        kc = torch.randn(batch * per, 16, hkv, d, device=dev, dtype=torch.bfloat16, generator=g).to(cache_dtype)
        caches.append((kc, torch.randn_like(kc, dtype=torch.bfloat16).to(cache_dtype)))
    md = AttentionMetadata.from_lens([1] * batch, device=dev)
    md.seq_lens = torch.full((batch,), context + 1, dtype=torch.int32, device=dev)
    md.max_seq_len = context + 1
    md.block_tables = torch.randperm(batch * per, device=dev, generator=g).to(torch.int32).view(batch, per)
    md.slot_mapping = (md.block_tables[:, context // 16].long() * 16 + context % 16).contiguous()
    feeds = {"q": torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16),
             "k": torch.randn(batch, hkv, d, device=dev, dtype=torch.bfloat16),
             "v": torch.randn(batch, hkv, d, device=dev, dtype=torch.bfloat16)}
    return feeds, md, caches


def time_point(prog, feeds, md, caches, iters: int = 20) -> float:
    def step():
        for c in caches:
            prog.run(feeds, md, [c])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            graph.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / iters / len(caches))
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--configs", default="[{}]", help="JSON list of launch.attention_decode entries over the default")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--contexts", default="128,512,2048")
    p.add_argument("--heads", default="16,8,128", help="query heads, KV heads, head dim (Qwen3-0.6B)")
    p.add_argument("--target", default="nvidia-h200")
    p.add_argument("--label", default="")
    p.add_argument("--kv-cache-dtype", default=None, help="the Plan's KV cache dtype (default: its pick)")
    a = p.parse_args()
    dev = torch.device("cuda")
    heads = tuple(int(x) for x in a.heads.split(","))
    batches = [int(x) for x in a.batches.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    rows = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i, cfg in enumerate(json.loads(a.configs)):
            prog, launch = build(cfg, heads, a.target, Path(tmp) / f"c{i}", a.kv_cache_dtype)
            cache_dtype = getattr(prog, "kv_dtype", torch.bfloat16)  # an older tree's program: its compute dtype
            for b in batches:
                for c in contexts:
                    kv = 2 * b * (c + 1) * heads[1] * heads[2] * cache_dtype.itemsize
                    copies = max(1, min(256, -(-(256 << 20) // kv)))
                    feeds, md, caches = case(b, c, heads, copies, dev, cache_dtype)
                    with torch.inference_mode():
                        us = time_point(prog, feeds, md, caches)
                    rows.append({"label": a.label, "config": launch, "cache": str(cache_dtype).removeprefix("torch."),
                                 "batch": b, "context": c, "us": round(us, 2),
                                 "kv_gbps": round(kv / us / 1e3, 1)})
                    print(f"{a.label} {json.dumps(cfg)} b={b} ctx={c}: {us:.2f} us ({kv / us / 1e3:.0f} GB/s)",
                          flush=True)
                    del caches
            del prog
    Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows,
                                       "seconds": round(time.time() - t0, 1)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
