"""``portlayer serve``: an artifact behind the OpenAI-compatible HTTP API (docs/serving.md).

ARTIFACT is a ``portlayer compile`` directory (hashes and device checked); a local HF
directory, a cached HF model id or a built-in name also works (captured now, reference
executable), which is handy for trying the API before compiling.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_parsers(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve an artifact over an OpenAI-compatible HTTP API",
                       description="Serve ARTIFACT on /v1/completions, /v1/chat/completions, /v1/embeddings, "
                                   "/v1/models, /health and /metrics (vLLM's routes).")  # fmt: skip
    s.add_argument("artifact", help="artifact directory from `portlayer compile`, or an HF directory / model id / built-in")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $PORTLAYER_API_KEY, else none)")
    s.add_argument("--served-model-name", action="append", default=None,
                   help="the name clients pass as `model` (repeat for aliases; default: ARTIFACT as given)")
    s.add_argument("--max-num-seqs", type=int, default=None, help="sequences batched at once (default: the Plan's)")
    s.add_argument("--max-batched-tokens", type=int, default=None, help="tokens per engine step (default: the Plan's)")
    s.add_argument("--kv-cache-budget-gib", type=float, default=None, help="KV cache size (default: the Plan's)")
    s.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    s.add_argument("--max-queue-len", type=int, default=1024,
                   help="requests waiting beyond --max-num-seqs before new ones get 503 (default 1024)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGINT/SIGTERM before they are aborted")
    s.add_argument("--seed", type=int, default=None, help="seed of the shared stream for unseeded sampled requests")
    s.add_argument("--device", default="cpu", help="torch device when ARTIFACT is a model, not an artifact (default cpu)")
    s.add_argument("--switch-interval-ms", type=float, default=1.0,
                   help="Python's GIL switch interval in this process (default 1 ms; Python's own is 5): the engine "
                        "thread waits at most this long for the GIL while the event loop streams")  # fmt: skip
    s.add_argument("--engine-core", choices=["auto", "process", "thread"], default="auto",
                   help="where the engine steps: 'process' (its own process, spawned; the HTTP side keeps its own "
                        "GIL), 'thread' (a thread of the server process), 'auto' (default): process where the "
                        "backend launches asynchronously (GPUs), thread elsewhere")  # fmt: skip
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=run_serve)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``LLMEngine.open`` keyword arguments from the flags (plain values: they also cross to the engine process)."""
    kw = {"device": args.device, "enable_prefix_caching": not args.no_prefix_caching, "seed": args.seed}
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_batched_tokens:
        kw["max_batched_tokens"] = args.max_batched_tokens
    if args.kv_cache_budget_gib:
        kw["kv_cache_budget_bytes"] = int(args.kv_cache_budget_gib * 2**30)
    return kw


def open_engine(args: argparse.Namespace):
    from portlayer.runtime.engine import LLMEngine

    return LLMEngine.open(args.artifact, **engine_kwargs(args))


def run_serve(args: argparse.Namespace) -> int:
    from portlayer.runtime.parallel.group import launched_by_torchrun
    from portlayer.runtime.serve import build_app, serve_forever
    from portlayer.runtime.serve.process_engine import ProcessEngine, default_engine_core
    from portlayer.runtime.serve.server import bind

    bind(args.host, args.port).close()  # a busy port fails now, before minutes of loading
    if args.switch_interval_ms > 0:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    os.environ.setdefault("PORTLAYER_TP_EXIT_ON_FAILURE", "1")  # a dead tensor-parallel rank stops the server
    mode = args.engine_core if args.engine_core != "auto" else default_engine_core(args.artifact, args.device)
    if launched_by_torchrun() and os.environ.get("RANK") != "0":
        mode = "thread"  # a torchrun worker rank serves steps, not HTTP: its engine call returns only at the end
    if mode == "process":
        print(f"[portlayer] loading {args.artifact} in the engine process (--engine-core process)", file=sys.stderr,
              flush=True)  # fmt: skip
    core = ProcessEngine(str(args.artifact), engine_kwargs(args), max_queue_len=args.max_queue_len) \
        if mode == "process" else None  # fmt: skip
    try:
        engine = core if core is not None else open_engine(args)
        names = args.served_model_name or [args.artifact]
        api_key = args.api_key or os.environ.get("PORTLAYER_API_KEY") or None
        app = build_app(engine, names, api_key=api_key, max_queue_len=args.max_queue_len, root=str(args.artifact))
        c = core.view.config if core is not None else engine.config
        where = f"engine process {core.proc.pid}" if core is not None else "engine thread"
        print(f"[portlayer] serving {names[0]!r} ({c.task}, max_model_len {c.max_model_len}, max_num_seqs "
              f"{c.max_num_seqs}, {c.num_blocks} KV blocks of {c.block_size}; {where}) on "
              f"http://{args.host}:{args.port}/v1{' (API key required)' if api_key else ''}",
              file=sys.stderr, flush=True)  # fmt: skip
        serve_forever(app, args.host, args.port, args.shutdown_timeout, args.log_level)
    finally:
        if core is not None:
            core.close()
    return 0
