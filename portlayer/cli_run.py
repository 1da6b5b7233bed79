"""``portlayer run`` and ``portlayer embed``: serve one request from an artifact (or a model) and print it.

ARTIFACT is a directory written by ``portlayer compile``; a local HF directory or a
built-in name also works (captured now and run with the reference executable), which is
handy before compiling. Results go to stdout, a throughput line to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from portlayer.errors import UsageError


class CLIUsageError(UsageError):
    """A command-line value that cannot be used as given."""


def add_parsers(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="generate tokens from a prompt",
                       description="Load ARTIFACT and generate a continuation of one prompt (greedy unless --temperature).")
    r.add_argument("artifact", help="artifact directory from `portlayer compile`, or an HF directory / built-in name")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (needs the model's tokenizer); repeat for several, "
                     "which are batched together")  # fmt: skip
    src.add_argument("--prompt-ids", action="append", help="prompt as comma-separated token ids, e.g. 1,2,3; repeatable")
    r.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (default 32)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    r.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    r.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    r.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    r.add_argument("--device", default="cpu", help="torch device when ARTIFACT is a model, not an artifact (default cpu)")
    r.add_argument("--chat", action="store_true",
                   help="send each --prompt as a user message rendered with the model's chat template")
    r.add_argument("--stream", action="store_true", help="print text as it is generated (prompts run one after another)")
    r.add_argument("--stop", action="append", default=[],
                   help="stop string (repeat for several): the output ends before it")
    r.add_argument("--json", action="store_true",
                   help='print {"token_ids": [...], "text": ..., "finish_reason": ...}, one line per prompt')
    r.add_argument("--interpret", action="store_true",
                   help="run a Triton artifact (CUDA/ROCm/XPU target) on this CPU under the Triton interpreter")
    r.set_defaults(func=run_generate)

    e = sub.add_parser("embed", help="embed texts with an embedding model",
                       description="Load ARTIFACT (an embedding/encoder model) and print one embedding per --text.")
    e.add_argument("artifact", help="artifact directory, or an HF directory / built-in name such as all-minilm-l6-v2")
    e.add_argument("--text", action="append", required=True, help="a text to embed; repeat for several")
    e.add_argument("--device", default="cpu", help="torch device when ARTIFACT is a model (default cpu)")
    e.add_argument("--json", action="store_true", help='print {"embeddings": [[...], ...]}')
    e.set_defaults(func=run_embed)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise CLIUsageError(f"--prompt-ids {text!r}: expected comma-separated integers such as 1,2,3") from None
    if not ids:
        raise CLIUsageError("--prompt-ids is empty; give at least one token id, e.g. --prompt-ids 1,2,3")
    return ids


def _open(args: argparse.Namespace):
    from portlayer.runtime.engine import LLMEngine

    if getattr(args, "interpret", False):
        return LLMEngine.from_artifact(args.artifact, interpret=True)
    return LLMEngine.open(args.artifact, device=args.device)


def _prompts(args: argparse.Namespace, engine) -> list:
    if args.prompt_ids is not None:
        if args.chat:
            raise CLIUsageError("--chat renders text messages; use it with --prompt, not --prompt-ids")
        return [parse_ids(p) for p in args.prompt_ids]
    if not args.chat:
        return list(args.prompt)
    from portlayer.runtime.chat import render_chat

    return [render_chat(engine.tokenizer, [{"role": "user", "content": p}]) for p in args.prompt]


def _generate(engine, prompts: list, params, stop: list[str], on_text=None) -> list[tuple]:
    """Run ``prompts`` together; stop strings end a request at once (its KV blocks freed).

    Returns (RequestOutput, text, stop string or None) per prompt; ``on_text(i, delta)`` sees text as it comes."""
    from portlayer.runtime.detokenizer import TextStream
    from portlayer.runtime.sequence import RequestOutput

    texts: dict[str, TextStream] = {}
    last: dict[str, RequestOutput] = {}
    order: list[str] = []
    for out in engine.stream(prompts, params):
        rid = out.request_id
        if rid not in texts:
            texts[rid] = TextStream(engine.tokenizer, stop)
            order.append(rid)
        ts = texts[rid]
        if out.error:
            raise CLIUsageError(out.error)
        delta = ts.add(out.new_token_ids, final=out.finished)
        if ts.stopped and not out.finished:
            engine.abort_request(rid)
        last[rid] = out
        if on_text is not None and delta:
            on_text(order.index(rid), delta)
    return [(last[r], texts[r].text if engine.tokenizer is not None else None, texts[r].stop_reason) for r in order]


def run_generate(args: argparse.Namespace) -> int:
    os.environ.setdefault("PORTLAYER_TP_EXIT_ON_FAILURE", "1")  # a dead tensor-parallel rank ends the command at once
    from portlayer.runtime.sequence import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)  # fmt: skip
    except ValueError as e:
        raise CLIUsageError(str(e)) from None
    engine = _open(args)
    if args.prompt_ids is None and engine.tokenizer is None:
        raise CLIUsageError(f"{args.artifact} has no tokenizer (its model directory had no tokenizer files), so "
                            "--prompt TEXT cannot be encoded; pass token ids instead: --prompt-ids 1,2,3")
    prompts = _prompts(args, engine)
    if args.stop and engine.tokenizer is None:
        raise CLIUsageError("--stop matches text, and this model has no tokenizer; drop --stop")
    t0 = time.perf_counter()
    if args.stream:  # one prompt at a time, so the text on screen is never interleaved
        results = []
        for i, p in enumerate(prompts):
            if i:
                print(flush=True)
            echo = (lambda _i, d: print(d, end="", flush=True)) if not args.json else None
            results += _generate(engine, [p], params, args.stop, echo)
            if echo is not None and results[-1][1] is None:
                print(" ".join(map(str, results[-1][0].token_ids)), end="")
        if not args.json:
            print(flush=True)
    else:
        results = _generate(engine, prompts, params, args.stop)
    dt = time.perf_counter() - t0
    for i, (out, text, stop) in enumerate(results):
        if args.json:
            print(json.dumps({"token_ids": out.token_ids, "text": text, "finish_reason": "stop" if stop else
                              out.finish_reason, "stop_reason": stop}))  # fmt: skip
        elif not args.stream:
            if i:
                print()
            print(text if text is not None else " ".join(map(str, out.token_ids)))
    n = sum(len(o.token_ids) for o, _, _ in results)
    np_ = sum(len(o.prompt_token_ids) for o, _, _ in results)
    reasons = ", ".join(sorted({"stop" if s else (o.finish_reason or "?") for o, _, s in results}))
    print(f"[portlayer] {np_} prompt + {n} generated tokens in {dt:.2f} s "
          f"({n / max(dt, 1e-9):.1f} tok/s, finish: {reasons})", file=sys.stderr)  # fmt: skip
    return 0


def run_embed(args: argparse.Namespace) -> int:
    engine = _open(args)
    if engine.tokenizer is None:
        raise CLIUsageError(f"{args.artifact} has no tokenizer (its model directory had no tokenizer files), so "
                            "--text cannot be encoded; embed token ids from Python: engine.embed([[1, 2, 3]])")
    t0 = time.perf_counter()
    emb = engine.embed(args.text)
    dt = time.perf_counter() - t0
    rows = emb.float().tolist()
    if args.json:
        print(json.dumps({"embeddings": rows}))
    else:
        for text, row in zip(args.text, rows):
            head = ", ".join(f"{x:.4f}" for x in row[:4])
            print(f"{text[:40]!r}: [{head}, ...] ({len(row)} dims)")
    print(f"[portlayer] {len(rows)} texts embedded in {dt:.2f} s ({len(rows) / max(dt, 1e-9):.1f} texts/s)",
          file=sys.stderr)  # fmt: skip
    return 0
