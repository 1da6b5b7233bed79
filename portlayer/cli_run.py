"""``portlayer run`` and ``portlayer embed``: serve one request from an artifact (or a model) and print it.

ARTIFACT is a directory written by ``portlayer compile``; a local HF directory or a
built-in name also works (captured now and run with the reference executable), which is
handy before compiling. Results go to stdout, a throughput line to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from portlayer.errors import PortlayerError


class CLIUsageError(PortlayerError):
    """A command-line value that cannot be used as given."""


def add_parsers(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="generate tokens from a prompt",
                       description="Load ARTIFACT and generate a continuation of one prompt (greedy unless --temperature).")
    r.add_argument("artifact", help="artifact directory from `portlayer compile`, or an HF directory / built-in name")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the model's tokenizer)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    r.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (default 32)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    r.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    r.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    r.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    r.add_argument("--device", default="cpu", help="torch device when ARTIFACT is a model, not an artifact (default cpu)")
    r.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": ...}')
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


def run_generate(args: argparse.Namespace) -> int:
    from portlayer.runtime.sequence import SamplingParams

    prompt = parse_ids(args.prompt_ids) if args.prompt_ids is not None else args.prompt
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)  # fmt: skip
    except ValueError as e:
        raise CLIUsageError(str(e)) from None
    engine = _open(args)
    t0 = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    dt = time.perf_counter() - t0
    if out.error:
        raise CLIUsageError(out.error)
    if args.json:
        print(json.dumps({"token_ids": out.token_ids, "text": out.text}))
    else:
        print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
    n = len(out.token_ids)
    print(f"[portlayer] {len(out.prompt_token_ids)} prompt + {n} generated tokens in {dt:.2f} s "
          f"({n / max(dt, 1e-9):.1f} tok/s, finish: {out.finish_reason})", file=sys.stderr)  # fmt: skip
    return 0


def run_embed(args: argparse.Namespace) -> int:
    engine = _open(args)
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
