"""GPU tier in one process: generated programs vs HF eager on the same GPU, CUDA graphs,
decode speed, and the per-kernel benchmark. Writes JSON under --out.

    python benchmarks/gpu_check.py --out $OUT            # on the H200
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --device cpu --tiny-only   # dry run

Checks (see docs/gpu.md): tiny Qwen3 in float32 gives the same 16 greedy tokens as HF
generate; a Qwen3-0.6B-shaped random bf16 model's logits stay within the spread HF itself
shows between float32 and bf16 (prefill of two packed sequences through the paged cache,
then decode steps, eager and replayed from CUDA graphs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bootstrap import bootstrap  # noqa: E402

bootstrap()

import torch  # noqa: E402


def log(*a) -> None:
    print(*a, flush=True)


def hf_qwen3(tiny: bool, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if tiny:
        cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
                          tie_word_embeddings=False)
    elif os.environ.get("PORTLAYER_GPU_CHECK_DRY") == "1":  # CPU smoke run of the 0.6B code path
        cfg = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=512,
                          tie_word_embeddings=True, rope_theta=1000000.0)
    else:
        cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                          tie_word_embeddings=True, rope_theta=1000000.0)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    if not tiny:  # HF's init (std 0.02) gives near-uniform logits; widen so greedy choices mean something
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(2.0)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    return model.to(dtype)


def compile_program(graph, device: str, out: Path, **plan_overrides):
    from portlayer.backends.generate import generate
    from portlayer.codegen.program import load_program, write_program
    from portlayer.passes.pipeline import run_pipeline

    t0 = time.time()
    r = run_pipeline(graph, "nvidia-h200", overrides=plan_overrides or None)
    plan = r.plan
    gen = generate(r.graph, plan, r.descriptor)
    write_program(gen, out)
    prog = load_program(out, r.graph.weights, device, max_seqs=64,
                        capture_sizes=plan.graph_capture_sizes if device == "cuda" else ())
    return prog, plan, time.time() - t0, gen


class PagedSeqs:
    """Just enough block management to drive a program through prefill and decode."""

    def __init__(self, graph, n_blocks: int, block: int, dtype, device) -> None:
        m = graph.meta
        self.block = block
        self.caches = [(torch.zeros(n_blocks, block, m["num_kv_heads"], m["head_dim"], dtype=dtype, device=device),
                        torch.zeros(n_blocks, block, m["num_kv_heads"], m["head_dim"], dtype=dtype, device=device))
                       for _ in range(m["num_layers"])]
        self.next_block = 0
        self.tables: list[list[int]] = []
        self.lens: list[int] = []

    def add(self, n: int) -> int:
        self.tables.append([])
        self.lens.append(0)
        return len(self.lens) - 1

    def step(self, new: list[int]):
        """Metadata for ``new[i]`` new tokens of sequence i (prefills first, as the contract says)."""
        from portlayer.flatten.op_defs.attention import AttentionMetadata

        starts, slots, positions = [0], [], []
        for i, n in enumerate(new):
            for p in range(self.lens[i], self.lens[i] + n):
                if p // self.block >= len(self.tables[i]):
                    self.tables[i].append(self.next_block)
                    self.next_block += 1
                slots.append(self.tables[i][p // self.block] * self.block + p % self.block)
                positions.append(p)
            self.lens[i] += n
            starts.append(starts[-1] + n)
        width = max(len(t) for t in self.tables)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(self.lens, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32),
            num_prefills=sum(1 for n in new if n > 1), max_query_len=max(new), max_seq_len=max(self.lens))
        return meta, torch.tensor(positions)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def check_tiny(device: str, out: Path) -> dict:
    from portlayer.flatten import capture

    graph = capture(hf_qwen3(True, torch.float32))  # capture swaps in portlayer's attention hook
    prog, plan, gen_s, gen = compile_program(graph, device, out / "tiny", compute_dtype="float32")
    model = hf_qwen3(True, torch.float32).to(device)  # same seed, same weights, HF eager attention
    prompt = torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = model.generate(prompt[None].to(device), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                            attention_mask=torch.ones(1, 8, dtype=torch.long, device=device))[0, 8:].tolist()
    seqs = PagedSeqs(graph, 8, plan.kv_block_size, torch.float32, device)
    seqs.add(8)
    meta, pos = seqs.step([8])
    logits = prog.run({"input_ids": prompt, "positions": pos}, meta, seqs.caches)[0]
    ours = [int(logits[-1].argmax())]
    for _ in range(15):
        meta, pos = seqs.step([1])
        logits = prog.run({"input_ids": torch.tensor([ours[-1]]), "positions": pos}, meta, seqs.caches)[0]
        ours.append(int(logits[-1].argmax()))
    res = {"hf_tokens": hf, "portlayer_tokens": ours, "match": hf == ours, "codegen_s": round(gen_s, 2),
           "graphs_captured": len(prog._graphs)}
    log("tiny-qwen3 fp32 greedy 16:", res)
    return res


def check_06b(device: str, out: Path, decode_steps: int = 8) -> dict:
    from portlayer.flatten import capture

    low = torch.float16 if os.environ.get("PORTLAYER_GPU_CHECK_DRY") == "1" else torch.bfloat16  # interpreter lacks bf16

    t0 = time.time()
    graph = capture(hf_qwen3(False, low))
    model = hf_qwen3(False, torch.float32)
    m16 = hf_qwen3(False, low)
    cap_s = time.time() - t0
    prog, plan, gen_s, gen = compile_program(graph, device, out / "q06b")
    eager, _, _, _ = compile_program(graph, device, out / "q06b_eager")
    eager.use_graphs = False
    m32, m16 = model.to(device), m16.to(device)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, graph.meta["vocab_size"], (n,), generator=g) for n in (100, 37)]
    seqs = PagedSeqs(graph, 64, plan.kv_block_size, low, device)
    for p in prompts:
        seqs.add(len(p))
    meta, pos = seqs.step([len(p) for p in prompts])
    ids = torch.cat(prompts)
    torch.cuda.synchronize() if device == "cuda" else None
    logits = prog.run({"input_ids": ids, "positions": pos}, meta, seqs.caches)[0].float()
    res: dict = {"capture_s": round(cap_s, 1), "codegen_s": round(gen_s, 2), "prefill": [], "decode": []}
    hist = [p.tolist() for p in prompts]
    starts = [0, len(prompts[0]), len(ids)]
    with torch.no_grad():
        for i, h in enumerate(hist):
            x = torch.tensor(h, device=device)[None]
            r32, r16 = m32(x).logits[0].float(), m16(x).logits[0].float()
            ours = logits[starts[i]:starts[i + 1]]
            res["prefill"].append({"ours_vs_fp32": rel(ours, r32), "hf_bf16_vs_fp32": rel(r16, r32),
                                   "argmax_agree_ours": float((ours.argmax(-1) == r32.argmax(-1)).float().mean()),
                                   "argmax_agree_hf_bf16": float((r16.argmax(-1) == r32.argmax(-1)).float().mean())})
        nxt = [int(logits[starts[i + 1] - 1].argmax()) for i in range(2)]
        for _ in range(decode_steps):
            for i in range(2):
                hist[i].append(nxt[i])
            meta, pos = seqs.step([1, 1])
            feeds = {"input_ids": torch.tensor(nxt), "positions": pos}
            step = prog.run(feeds, meta, seqs.caches)[0].float()
            again = eager.run(feeds, meta, [(k.clone(), v.clone()) for k, v in seqs.caches])[0].float()
            row = {"graph_vs_eager": rel(step, again)}
            for i, h in enumerate(hist):
                x = torch.tensor(h, device=device)[None]
                r32, r16 = m32(x).logits[0, -1].float(), m16(x).logits[0, -1].float()
                row[f"seq{i}"] = {"ours_vs_fp32": rel(step[i], r32), "hf_bf16_vs_fp32": rel(r16, r32)}
            res["decode"].append(row)
            nxt = [int(step[i].argmax()) for i in range(2)]
    res["graphs_captured"] = len(prog._graphs)
    worst = max(p["ours_vs_fp32"] / p["hf_bf16_vs_fp32"] for p in res["prefill"])
    worst_d = max(r[f"seq{i}"]["ours_vs_fp32"] / r[f"seq{i}"]["hf_bf16_vs_fp32"] for r in res["decode"] for i in (0, 1))
    res["worst_ratio_prefill"], res["worst_ratio_decode"] = worst, worst_d
    log("qwen3-0.6B-shape bf16:", json.dumps({k: v for k, v in res.items() if k not in ("decode",)}, indent=1))
    log("decode rows:", json.dumps(res["decode"][:2]), "...")
    if device == "cuda":
        res["decode_speed"] = decode_speed(prog, eager, graph, plan)
    return res


def decode_speed(prog, eager, graph, plan, ctx: int = 512) -> list[dict]:
    rows = []
    for batch in (1, 16, 64):
        seqs = PagedSeqs(graph, batch * (ctx // plan.kv_block_size + 2), plan.kv_block_size, torch.bfloat16, "cuda")
        for _ in range(batch):
            seqs.add(ctx)
        seqs.lens = [ctx - 1] * batch
        seqs.tables = [list(range(i * (ctx // 16 + 1), (i + 1) * (ctx // 16 + 1))) for i in range(batch)]
        seqs.next_block = batch * (ctx // 16 + 1)
        meta, pos = seqs.step([1] * batch)
        feeds = {"input_ids": torch.randint(0, 1000, (batch,)), "positions": pos}
        out = {"batch": batch, "context": ctx}
        for name, p in (("graphs", prog), ("eager", eager)):
            for _ in range(3):
                p.run(feeds, meta, seqs.caches)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            n = 20
            for _ in range(n):
                p.run(feeds, meta, seqs.caches)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / n * 1e3
            out[f"{name}_ms_per_step"] = round(ms, 3)
            out[f"{name}_tok_s"] = round(batch / ms * 1e3, 1)
        rows.append(out)
        log("decode speed:", out)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", tempfile.mkdtemp())))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny-only", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="portlayer-gpu-"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(work / "triton-cache"))
    results: dict = {"torch": torch.__version__}
    import transformers
    import triton

    results.update(triton=triton.__version__, transformers=transformers.__version__)
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    log(results)
    steps = [("tiny", lambda: check_tiny(args.device, work))]
    if not args.tiny_only:
        steps.append(("qwen3_06b", lambda: check_06b(args.device, work)))
        if not args.no_bench:
            from bench_kernels import run_all

            steps.append(("bench", lambda: run_all(args.out / "bench_kernels.json")))
    for name, fn in steps:
        t0 = time.time()
        try:
            results[name] = fn()
        except Exception as e:  # keep going: one failure must not hide the other results
            import traceback

            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        log(f"[{name}] {time.time() - t0:.1f}s")
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
