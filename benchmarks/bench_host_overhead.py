"""Host overhead of one engine step, with the model replaced by a program that does nothing.

What is left is pure runtime cost per step — scheduling, block allocation, building the
step's metadata, sampling, outputs — which on a GPU is time the device waits unless it is
overlapped. Prints a table and writes JSON.

    python benchmarks/bench_host_overhead.py --json host.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bootstrap import bootstrap  # noqa: E402

bootstrap()

import torch  # noqa: E402


class NullProgram:
    """The Executable interface with no work: logits of zeros for every sequence of the step."""

    device = torch.device("cpu")
    dtype = torch.float32
    input_names = ("input_ids", "positions", "logits_indices")

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def run(self, feeds, attn_metadata, kv_caches):
        return [torch.zeros(len(attn_metadata.seq_lens), self.vocab)]


def measure(batch: int, prompt: int, warm_steps: int, steps: int, vocab: int) -> dict:
    from portlayer.backends.registry import get_backend
    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.sequence import SamplingParams

    meta = {"task": "causal_lm", "vocab_size": vocab, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8,
            "max_positions": 1 << 16, "dtype": "float32"}  # fmt: skip
    eng = LLMEngine(NullProgram(vocab), meta, None, backend=get_backend("cpu"), max_num_seqs=batch,
                    max_batched_tokens=max(8192, batch * prompt), prefill_chunk_size=max(8192, prompt),
                    kv_cache_budget_bytes=1 << 28)  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(list(range(prompt)), sp)
    for _ in range(warm_steps):
        eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    ms = (time.perf_counter() - t0) / steps * 1000
    return {"batch": batch, "prompt": prompt, "outputs_so_far": warm_steps, "host_ms_per_step": round(ms, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--prompt", type=int, default=600)
    p.add_argument("--warm-steps", type=int, default=330, help="decode steps before timing (output length)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = [measure(int(b), args.prompt, args.warm_steps, args.steps, 1000) for b in args.batches.split(",")]
    print(f"{'batch':>6} {'host ms/step':>13}  (prompt {args.prompt}, {args.warm_steps} outputs so far)")
    for r in rows:
        print(f"{r['batch']:>6} {r['host_ms_per_step']:>13.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": rows, "command": " ".join(sys.argv)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
