"""Generate tokens with a tiny random-weight Qwen3 through the compiled artifact and the runtime engine.

    python examples/generate_tiny_qwen3.py [--target auto|NAME|path.json] [--tokens N]

The weights are random (seeded), so the text is noise; what matters is the path: compile
→ verified artifact → executable → engine with a paged KV cache and continuous batching.
"""

from __future__ import annotations

import argparse

import portlayer
from portlayer.runtime.sequence import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="auto")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()

    art = portlayer.compile("tiny-qwen3", target=args.target, progress=False)
    print(art)
    model = art.load()
    print(f"plan: {model.plan.compute_dtype}, KV block {model.plan.kv_block_size}, "
          f"prefill chunk {model.plan.prefill_chunk_size}")
    engine = model.engine()
    prompts = ["Hello, portlayer", "The quick brown fox", [1, 2, 3, 4, 5]]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for prompt, out in zip(prompts, engine.generate(prompts, greedy)):
        print(f"  {str(prompt)!r:<24} -> {out.token_ids} ({out.finish_reason})")
    print(f"{engine.num_steps} engine steps for {len(prompts)} requests (batched)")


if __name__ == "__main__":
    main()
