"""The embedded default: ``python -m portlayer.demo`` — offline, on whatever this machine has.

It compiles the bundled all-MiniLM-L6-v2 for the best local device, checks the artifact
against its validation set, prints sentence similarities, then compiles a tiny Qwen3
(random weights, byte tokenizer) and generates tokens through the runtime engine. A
second run is a cache hit for both models.
"""

from __future__ import annotations

import argparse
import sys

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m portlayer.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="auto", help="descriptor name, 'auto' or path.json")
    ap.add_argument("--tokens", type=int, default=24, help="tokens to generate with tiny Qwen3")
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

        art = portlayer.compile("tiny-qwen3", target=args.target, progress=not args.no_progress)
        print(f"\n{art}")
        qwen = art.load()
        out = qwen.generate("Hello, portlayer", max_tokens=args.tokens)
        print(f"tiny Qwen3 (random weights, so the text is noise) generated {len(out.token_ids)} tokens:")
        print(f"  ids:  {list(out.token_ids)}")
        print(f"  text: {out.text!r}")
    except PortlayerError as e:
        print(f"portlayer demo: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
