"""Serving benchmark: continuous batching over the paged KV cache, through any Executable.

Workload (the runtime issue's): 256 sequences, input and output lengths uniform in
[100, 1024], seed 0, random token ids, greedy, EOS ignored, all submitted at once, on a
Qwen3-0.6B-shaped random-weight bf16 model (hidden 1024, intermediate 3072, 28 layers,
16 heads, 8 KV heads, head_dim 128, vocab 151936, tied embeddings). Reports output
tokens/s for that workload, and decode tokens/s at fixed batch sizes (default 1, 16, 64:
B requests prefilled, then N pure-decode steps timed).

The program is the reference executable (torch ops, on whatever device) unless
``--artifact DIR`` names a compiled artifact, whose generated host program is then used:
the engine only sees the Executable interface. ``--time-limit`` stops the serving phase
early and says so in the JSON (``complete: false``): the reference executable is far too
slow for the whole workload in a short device lease.

    python benchmarks/bench_serving.py --device cuda --json out.json
    python benchmarks/bench_serving.py --layers 2 --vocab 512 --num-seqs 8 --min-len 8 --max-len 32  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bootstrap import bootstrap  # noqa: E402

bootstrap()  # `import portlayer` from a plain checkout (the GPU machine has no install)


def build_model(layers: int, vocab: int, seed: int) -> torch.nn.Module:
    """Qwen3-0.6B's shape with seeded random bf16 weights (nothing downloaded). Initialised on the GPU
    where there is one (HF's random init of 0.6 B parameters takes ~45 s on the H200 host's CPU), then
    moved to the CPU: the compile reads it from there like a checkpoint."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=vocab, tie_word_embeddings=True,
                      max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6)  # fmt: skip
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    init = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        with torch.device(init):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.to("cpu").eval()


def make_engine(args: argparse.Namespace, timings: dict[str, float]) -> tuple[Any, str]:
    from portlayer.runtime.engine import LLMEngine

    kw: dict[str, Any] = {"enable_prefix_caching": False}  # random prompts share nothing
    if args.kv_budget_gib:
        kw["kv_cache_budget_bytes"] = int(args.kv_budget_gib * 2**30)
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_batched_tokens:
        kw["max_batched_tokens"] = args.max_batched_tokens
    t0 = time.perf_counter()
    if args.compile_target and not args.artifact:  # compile the synthetic model: capture -> passes -> codegen
        import tempfile

        import portlayer

        model = build_model(args.layers, args.vocab, args.seed)
        timings["build_model_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = args.artifact_out or os.path.join(tempfile.mkdtemp(prefix="bench-serving-"), "artifact")
        portlayer.compile(model, target=args.compile_target, output=out, progress=False, quantize=args.quantize,
                          calibration_device=args.calibration_device, kv_cache_dtype=args.kv_cache_dtype)
        timings["compile_s"] = time.perf_counter() - t0
        del model
        args.artifact = out
        t0 = time.perf_counter()
    if args.artifact:
        eng = LLMEngine.from_artifact(args.artifact, **kw)
        timings["load_s"] = time.perf_counter() - t0
        return eng, f"artifact {args.artifact}: {type(eng.executable).__module__}.{type(eng.executable).__name__}"
    from portlayer.backends.registry import get_backend
    from portlayer.capabilities.policy import plan_for_graph
    from portlayer.flatten.capture import capture
    from portlayer.runtime.executable import ReferenceExecutable

    model = build_model(args.layers, args.vocab, args.seed)
    timings["build_model_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    graph = capture(model)
    timings["capture_s"] = time.perf_counter() - t0
    del model
    exe = ReferenceExecutable(graph, device=args.device)
    backend = get_backend(exe.device.type)
    try:
        plan = plan_for_graph(graph, args.descriptor or backend.descriptor)
    except Exception as e:  # no descriptor matched here: engine defaults, said in the JSON
        print(f"[bench] no plan ({type(e).__name__}: {e}); using engine defaults", file=sys.stderr)
        plan = None
    eng = LLMEngine(exe, graph.meta, plan, backend=backend, **kw)
    return eng, "reference executable (portlayer.runtime.executable.ReferenceExecutable, torch ops)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_serving(eng: Any, args: argparse.Namespace) -> dict[str, Any]:
    from portlayer.runtime.sequence import SamplingParams

    g = torch.Generator().manual_seed(args.seed)
    lo, hi, vocab = args.min_len, args.max_len, int(eng.meta["vocab_size"])
    ins = torch.randint(lo, hi + 1, (args.num_seqs,), generator=g).tolist()
    outs = torch.randint(lo, hi + 1, (args.num_seqs,), generator=g).tolist()
    rids = []
    for n_in, n_out in zip(ins, outs):
        prompt = torch.randint(0, vocab, (n_in,), generator=g).tolist()
        rids.append(eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)))
    generated = finished = steps = 0
    sync(eng.executable.device)
    t0 = time.perf_counter()
    while eng.has_unfinished() and time.perf_counter() - t0 < args.time_limit:
        for o in eng.step():
            generated += len(o.new_token_ids)
            finished += o.finished
        steps += 1
    sync(eng.executable.device)
    dt = time.perf_counter() - t0
    complete = not eng.has_unfinished()
    for r in rids:
        eng.abort(r)
    return {"num_seqs": args.num_seqs, "input_tokens": sum(ins), "target_output_tokens": sum(outs),
            "finished_seqs": finished, "output_tokens": generated, "steps": steps, "seconds": round(dt, 3),
            "output_tok_s": round(generated / dt, 2), "complete": complete,
            "preemptions": eng.stats["preemptions"]}  # fmt: skip


def run_eager_check(eng: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The same greedy requests (``--check-eager`` of them, lengths as serving's, ``--check-tokens`` out) on the
    engine as it runs (CUDA graphs, overlapped steps), then with graphs and overlap off: how many sequences'
    tokens are equal, and where the others first differ (the padded graph GEMMs may round differently)."""
    from portlayer.runtime.sequence import SamplingParams

    g = torch.Generator().manual_seed(args.seed + 11)
    vocab = int(eng.meta["vocab_size"])
    lens = torch.randint(args.min_len, args.max_len + 1, (args.check_eager,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    params = SamplingParams(temperature=0.0, max_tokens=args.check_tokens, ignore_eos=True)
    fast = [o.token_ids for o in eng.generate(prompts, params)]
    exe = eng.executable
    graphs, overlap = getattr(exe, "use_graphs", False), eng.overlap
    if graphs:
        exe.use_graphs = False
    eng.overlap = False
    try:
        slow = [o.token_ids for o in eng.generate(prompts, params)]
    finally:
        if graphs:
            exe.use_graphs = True
        eng.overlap = overlap
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(fast, slow)]
    return {"seqs": len(prompts), "tokens_each": args.check_tokens, "equal_seqs": sum(f is None for f in first),
            "first_difference_at": sorted(f for f in first if f is not None)}


def run_first_request(eng: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The first request after load: a 128-token prompt, one token out (anything compiled or
    captured on first use is in this figure)."""
    from portlayer.runtime.sequence import SamplingParams

    g = torch.Generator().manual_seed(args.seed + 7)
    prompt = torch.randint(0, int(eng.meta["vocab_size"]), (128,), generator=g).tolist()
    t0 = time.perf_counter()
    eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    sync(eng.executable.device)
    return {"prompt_tokens": 128, "first_request_ms": round(1000 * (time.perf_counter() - t0), 2)}


def run_prefill(eng: Any, spec: str, args: argparse.Namespace) -> dict[str, Any]:
    """``N x L``: N prompts of L tokens submitted at once, one output token each; prompt tokens/s."""
    from portlayer.runtime.sequence import SamplingParams

    n, length = (int(v) for v in spec.lower().split("x"))
    g = torch.Generator().manual_seed(args.seed + 11)
    vocab = int(eng.meta["vocab_size"])
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    warm = [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]
    eng.generate(warm, sp)  # warm-up: every prefill bucket of this shape has run once
    prompts = [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]
    sync(eng.executable.device)
    t0 = time.perf_counter()
    eng.generate(prompts, sp)
    sync(eng.executable.device)
    dt = time.perf_counter() - t0
    return {"prompts": n, "prompt_len": length, "seconds": round(dt, 4), "prefill_tok_s": round(n * length / dt, 1)}


def run_decode(eng: Any, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Prefill ``batch`` requests of ``--decode-context`` tokens, then time pure-decode steps."""
    from portlayer.runtime.sequence import SamplingParams

    g = torch.Generator().manual_seed(args.seed + batch)
    vocab = int(eng.meta["vocab_size"])
    # Early-admitted requests decode while later ones prefill: give them room to outlive the timed steps.
    sp = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    rids = [eng.add_request(torch.randint(0, vocab, (args.decode_context,), generator=g).tolist(), sp)
            for _ in range(batch)]  # fmt: skip
    seqs = [eng.requests[r] for r in rids]
    while any(not s.output_token_ids for s in seqs):
        eng.step()
    eng.step()  # one untimed decode (warm-up of this batch shape)
    sync(eng.executable.device)
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    for _ in range(args.decode_steps):
        batch_now = eng.scheduler.running
        assert len(batch_now) == batch and all(s.num_uncomputed_tokens == 1 for s in batch_now), "not a pure decode"
        eng.step()
    sync(eng.executable.device)
    dt = time.perf_counter() - t0
    if prof is not None:
        import io
        import pstats

        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
        print(f"[bench] profile of {args.decode_steps} decode steps at batch {batch}:\n{buf.getvalue()}", file=sys.stderr)
    for r in rids:
        eng.abort(r)
    return {"batch": batch, "context": args.decode_context, "steps": args.decode_steps,
            "step_ms": round(1000 * dt / args.decode_steps, 3), "decode_tok_s": round(batch * args.decode_steps / dt, 2)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--artifact", default=None, help="compiled artifact directory (its generated program is used)")
    p.add_argument("--compile-target", default=None,
                   help="compile the synthetic model for this descriptor (name, 'auto' or path) and serve the generated program")
    p.add_argument("--quantize", default=None, choices=("none", "int8", "int4"),
                   help="with --compile-target: weight-only quantization of the compiled artifact")
    p.add_argument("--calibration-device", default=None,
                   help="with --quantize: where the quantize pass calibrates and the quality gate runs (e.g. cuda)")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="with --compile-target: the KV cache's element type (default: the Plan's pick)")
    p.add_argument("--artifact-out", default=None, help="with --compile-target: write the artifact here (to validate it later)")
    p.add_argument("--descriptor", default=None, help="descriptor for the plan (default: the backend's probed one)")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--time-limit", type=float, default=float("inf"), help="stop the serving phase after this many seconds")
    p.add_argument("--decode-batches", default="1,16,64")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--kv-budget-gib", type=float, default=None, help="KV cache size (default: the plan's budget)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-batched-tokens", type=int, default=None)
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--first-request", action="store_true", help="time the first request after load (before anything else)")
    p.add_argument("--prefill", default=None, metavar="NxL", help="time N prompts of L tokens (one output token each)")
    p.add_argument("--check-eager", type=int, default=0, metavar="N",
                   help="after serving: N greedy requests with graphs and overlap, then without; are the tokens equal")
    p.add_argument("--check-tokens", type=int, default=64, help="output tokens per --check-eager request")
    p.add_argument("--profile", action="store_true", help="print a cProfile of the timed decode steps (host overhead)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    args = p.parse_args(argv)

    timings: dict[str, float] = {}
    eng, program = make_engine(args, timings)
    dev = eng.executable.device
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    print(f"[bench] {program} on {gpu}; {eng.config}", file=sys.stderr)
    result: dict[str, Any] = {
        "gpu": gpu, "device": str(dev), "program": program, "torch": torch.__version__,
        "model": {"shape": "Qwen3-0.6B", "layers": args.layers, "vocab": args.vocab, "dtype": str(eng.executable.dtype)},
        "engine": {k: v for k, v in vars(eng.config).items()}, "timings": timings,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }  # fmt: skip
    if args.first_request:
        result["first_request"] = run_first_request(eng, args)
        print(f"[bench] first request: {json.dumps(result['first_request'])}", file=sys.stderr)
    if args.prefill:
        result["prefill"] = run_prefill(eng, args.prefill, args)
        print(f"[bench] prefill: {json.dumps(result['prefill'])}", file=sys.stderr)
    if not args.skip_serving:
        result["serving"] = run_serving(eng, args)
        print(f"[bench] serving: {json.dumps(result['serving'])}", file=sys.stderr)
    if args.check_eager:
        result["eager_check"] = run_eager_check(eng, args)
        print(f"[bench] eager check: {json.dumps(result['eager_check'])}", file=sys.stderr)
    result["decode"] = []
    for b in (int(x) for x in args.decode_batches.split(",") if x):
        result["decode"].append(run_decode(eng, b, args))
        print(f"[bench] decode: {json.dumps(result['decode'][-1])}", file=sys.stderr)
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
