"""HTTP serving benchmark: N concurrent streaming clients against `portlayer serve` on 127.0.0.1.

Workload (bench_serving.py's, by default): 256 requests, input and output lengths uniform in
[100, 1024], seed 0, random token ids, greedy, EOS ignored, all sent at once (``--clients``
concurrent clients, ``--requests-per-client`` each, one after another). The server is started
here as a subprocess (``python -m portlayer.cli serve ARTIFACT --port P``) with the same engine
options as the offline run, driven with httpx streaming (SSE) on loopback, and stopped at the
end. Reports requests/s, output tokens/s, p50/p99 time to first token (TTFT) and inter-token
latency (ITL: gaps between a request's successive chunks; one chunk carries one step's tokens).

``--offline`` runs the same workload through ``LLMEngine`` in this process (no HTTP);
``--compare`` runs offline first (in a fresh process, so its GPU memory is gone before the server
starts), then HTTP, and prints HTTP/offline output tokens/s. ``--engine-core`` picks where the
server steps the engine (``process``, the default here: the engine-core process; ``thread``; or
``process,thread`` for one HTTP run of each, in that order). Bounded:
``--time-limit`` seconds per phase, then outstanding requests are cancelled (``complete: false``).

    PYTHONPATH=. python benchmarks/bench_server.py ART --compare --json docs/gpu-results/bench_server_h200.json
    python benchmarks/bench_server.py tiny-qwen3 --compare --num-seqs 32 --min-len 8 --max-len 32   # CPU smoke
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bootstrap import bootstrap  # noqa: E402

bootstrap()  # `import portlayer` from a plain checkout (the GPU machine has no install)


def workload(vocab: int, n: int, lo: int, hi: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request, drawn exactly as bench_serving.py draws them."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ins = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    outs = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [(torch.randint(0, vocab, (k,), generator=g).tolist(), m) for k, m in zip(ins, outs)]


def percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50_ms": None, "p99_ms": None, "mean_ms": None}
    s = sorted(xs)

    def q(p: float) -> float:
        return 1000 * s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]

    return {"p50_ms": round(q(0.50), 3), "p99_ms": round(q(0.99), 3), "mean_ms": round(1000 * sum(s) / len(s), 3)}


def summarize(mode: str, per_req: list[dict[str, Any]], seconds: float, total: int) -> dict[str, Any]:
    done = [r for r in per_req if r.get("done")]
    out_tok = sum(r["tokens"] for r in per_req)
    itl = [g for r in per_req for g in r["gaps"]]
    return {"mode": mode, "requests": total, "completed": len(done), "complete": len(done) == total,
            "output_tokens": out_tok, "seconds": round(seconds, 3), "requests_s": round(len(done) / seconds, 3),
            "output_tok_s": round(out_tok / seconds, 2), "ttft": percentiles([r["ttft"] for r in per_req if "ttft" in r]),
            "itl": percentiles(itl)}  # fmt: skip


# ---- offline: the engine in this process ----------------------------------------------------
def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {"enable_prefix_caching": False}  # random prompts share nothing (as bench_serving)
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_batched_tokens:
        kw["max_batched_tokens"] = args.max_batched_tokens
    if args.kv_cache_budget_gib:
        kw["kv_cache_budget_bytes"] = int(args.kv_cache_budget_gib * 2**30)
    return kw


def run_offline(args: argparse.Namespace, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.sequence import SamplingParams

    eng = LLMEngine.open(args.artifact, device=args.device, **engine_kwargs(args))
    warm(eng)
    t0 = time.perf_counter()
    per = {eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)): {"tokens": 0, "gaps": []}
           for p, m in reqs}  # fmt: skip
    last: dict[str, float] = {}
    while eng.has_unfinished() and time.perf_counter() - t0 < args.time_limit:
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            r = per[o.request_id]
            if o.request_id in last:
                r["gaps"].append(now - last[o.request_id])
            else:
                r["ttft"] = now - t0
            last[o.request_id] = now
            r["tokens"] += len(o.new_token_ids)
            r["done"] = o.finished
    dt = time.perf_counter() - t0
    for rid in per:
        eng.abort_request(rid)
    result = summarize("offline", list(per.values()), dt, len(reqs))
    result["engine"] = dict(vars(eng.config))
    del eng
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass
    return result


def warm(eng: Any) -> None:
    """A few short requests first (kernel loads, graph captures of small buckets), untimed, in both modes."""
    from portlayer.runtime.sequence import SamplingParams

    eng.generate([[1 + i] * 16 for i in range(4)], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


# ---- HTTP: a server subprocess, httpx clients ----------------------------------------------------
def start_server(args: argparse.Namespace, port: int, core: str) -> subprocess.Popen:
    import portlayer

    src_root = str(Path(portlayer.__file__).resolve().parent.parent)  # the bootstrap layout, or the install
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src_root, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "portlayer.cli", "serve", args.artifact, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "bench", "--no-prefix-caching", "--log-level", "warning", "--device", args.device,
           "--max-queue-len", str(max(1024, args.num_seqs)), "--engine-core", core]  # fmt: skip
    cmd += args.server_arg
    for flag, v in (("--max-num-seqs", args.max_num_seqs), ("--max-batched-tokens", args.max_batched_tokens),
                    ("--kv-cache-budget-gib", args.kv_cache_budget_gib)):  # fmt: skip
        if v:
            cmd += [flag, str(v)]
    return subprocess.Popen(cmd, env=env)


async def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"[bench] the server exited with status {proc.returncode} before it was ready")
            try:
                if (await c.get(url + "/health", timeout=2)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.25)
    raise SystemExit(f"[bench] the server at {url} was not ready after {timeout:.0f} s")


async def one_request(c: Any, prompt: list[int], max_tokens: int, rec: dict[str, Any]) -> None:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}  # fmt: skip
    t0 = last = time.perf_counter()
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            now = time.perf_counter()
            if ch.get("choices"):
                n = len(ch["choices"][0].get("token_ids") or [])
                if n:
                    if "ttft" in rec:
                        rec["gaps"].append(now - last)
                    else:
                        rec["ttft"] = now - t0
                    last = now
                    rec["tokens"] += n
            elif ch.get("usage"):
                rec["usage_tokens"] = ch["usage"]["completion_tokens"]
                rec["done"] = True
            elif "error" in ch:
                rec["error"] = ch["error"].get("message")


async def run_clients(url: str, args: argparse.Namespace, reqs: list[tuple[list[int], int]],
                      mode: str = "http") -> dict[str, Any]:  # fmt: skip
    import httpx

    recs = [{"tokens": 0, "gaps": []} for _ in reqs]
    per_client = max(1, args.requests_per_client)
    clients = -(-len(reqs) // per_client)
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(args.time_limit + 60)) as c:
        await one_request(c, [1] * 16, 4, {"tokens": 0, "gaps": []})  # warm-up, as the offline run

        async def client(k: int) -> None:
            for i in range(k * per_client, min(len(reqs), (k + 1) * per_client)):
                await one_request(c, reqs[i][0], reqs[i][1], recs[i])

        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(client(k)) for k in range(clients)]
        _, pending = await asyncio.wait(tasks, timeout=args.time_limit)
        for t in pending:  # bounded: cancelling closes the streams, the server aborts those requests
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        dt = time.perf_counter() - t0
    result = summarize(mode, recs, dt, len(reqs))
    errors = [r["error"] for r in recs if "error" in r]
    mismatch = sum(1 for r in recs if r.get("done") and r.get("usage_tokens") != r["tokens"])
    result.update(clients=clients, requests_per_client=per_client, errors=len(errors), first_error=errors[:1],
                  usage_mismatches=mismatch)  # fmt: skip
    return result


def run_http(args: argparse.Namespace, reqs: list[tuple[list[int], int]], core: str) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", args.port))
        port = s.getsockname()[1]
    proc = start_server(args, port, core)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_ready(url, proc, args.startup_timeout))
        result = asyncio.run(run_clients(url, args, reqs, f"http-{core}"))
        result["engine_core"] = core
        return result
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def offline_subprocess(argv: list[str]) -> dict[str, Any]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-server-") as d:
        out = os.path.join(d, "offline.json")
        rest = [a for a in argv if a != "--compare"]
        subprocess.run([sys.executable, os.path.abspath(__file__), *rest, "--offline", "--json", out], check=True)
        return json.loads(Path(out).read_text())["results"][0]


def vocab_of(spec: str) -> int:
    from portlayer.runtime.artifact import MANIFEST

    if (Path(spec) / MANIFEST).is_file():  # only the IR's meta is needed (the server verifies the artifact)
        from portlayer.flatten.serialize import GRAPH_FILE

        return int(json.loads((Path(spec) / GRAPH_FILE).read_text())["meta"]["vocab_size"])
    from transformers import AutoConfig

    from portlayer.builtin_models import resolve_model

    return int(AutoConfig.from_pretrained(str(resolve_model(spec))).vocab_size)


def table(results: list[dict[str, Any]]) -> str:
    head = (f"{'mode':<12} {'done':>9} {'out tok':>9} {'s':>8} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms)")  # fmt: skip
    rows = [head]
    for r in results:
        rows.append(f"{r['mode']:<12} {r['completed']:>4}/{r['requests']:<4} {r['output_tokens']:>9} {r['seconds']:>8.2f} "
                    f"{r['requests_s']:>8.2f} {r['output_tok_s']:>10.1f} {r['ttft']['p50_ms'] or 0:>9.1f} "
                    f"{r['ttft']['p99_ms'] or 0:>9.1f} {r['itl']['p50_ms'] or 0:>8.2f} {r['itl']['p99_ms'] or 0:>8.2f}")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", help="artifact directory (or an HF directory / built-in name, captured on the spot)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--offline", action="store_true", help="only the engine in this process, no HTTP")
    mode.add_argument("--compare", action="store_true", help="offline, then HTTP; report HTTP / offline tok/s")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests-per-client", type=int, default=1, help="each client sends this many, one after another")
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds per phase before outstanding requests are cancelled")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for the server to load the artifact")
    p.add_argument("--port", type=int, default=0, help="server port on 127.0.0.1 (default: a free one)")
    p.add_argument("--device", default="cpu", help="torch device when ARTIFACT is a model, not an artifact")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-budget-gib", type=float, default=None)
    p.add_argument("--engine-core", default="process",
                   help="`portlayer serve --engine-core` of the HTTP run(s): process (default), thread, auto, or a "
                        "comma list such as process,thread (one HTTP run each, in order)")  # fmt: skip
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra `portlayer serve` argument, e.g. --server-arg=--switch-interval-ms=5 (repeatable)")
    p.add_argument("--json", default=str(Path(__file__).resolve().parents[1] / "docs" / "gpu-results" / "bench_server.json"),
                   help="write the results here (default docs/gpu-results/bench_server.json)")  # fmt: skip
    args = p.parse_args(argv)
    cores = [c.strip() for c in args.engine_core.split(",") if c.strip()]
    bad = [c for c in cores if c not in ("process", "thread", "auto")]
    if bad or not cores:
        p.error(f"--engine-core {args.engine_core!r}: give process, thread, auto or a comma list of them")

    reqs = workload(vocab_of(args.artifact), args.num_seqs, args.min_len, args.max_len, args.seed)
    print(f"[bench] {len(reqs)} requests, {sum(len(r[0]) for r in reqs)} prompt tokens, "
          f"{sum(r[1] for r in reqs)} output tokens wanted", file=sys.stderr)  # fmt: skip
    results = []
    if args.offline:
        results.append(run_offline(args, reqs))
    elif args.compare:  # offline in a fresh process, so its KV cache and program are gone before the server starts
        results.append(offline_subprocess(argv if argv is not None else sys.argv[1:]))
    if results:
        print(f"[bench] offline: {results[-1]['output_tok_s']} out tok/s", file=sys.stderr)
    if not args.offline:
        for core in cores:
            print(f"[bench] http, engine core: {core}", file=sys.stderr)
            results.append(run_http(args, reqs, core))
            print(f"[bench] http (engine core {core}): {results[-1]['output_tok_s']} out tok/s", file=sys.stderr)
    import torch

    doc: dict[str, Any] = {
        "artifact": args.artifact, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else
        platform.processor() or platform.machine(), "torch": torch.__version__,
        "workload": {"num_seqs": args.num_seqs, "min_len": args.min_len, "max_len": args.max_len, "seed": args.seed,
                     "requests_per_client": args.requests_per_client},
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "results": results,
    }  # fmt: skip
    if args.compare:
        base = max(results[0]["output_tok_s"], 1e-9)
        doc["http_over_offline"] = round(results[1]["output_tok_s"] / base, 4)  # the first HTTP run's engine core
        doc["http_over_offline_by_core"] = {r["engine_core"]: round(r["output_tok_s"] / base, 4) for r in results[1:]}
    print(table(results))
    for core, ratio in doc.get("http_over_offline_by_core", {}).items():
        print(f"HTTP (engine core {core}) / offline output tok/s: {ratio:.3f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"[bench] wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
