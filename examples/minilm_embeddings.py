"""Sentence embeddings with the bundled all-MiniLM-L6-v2, compiled for this machine.

    python examples/minilm_embeddings.py [--target auto|NAME|path.json]

Compiles (or reuses from the cache) an artifact, validates it on the local device, and
ranks a few documents against a query by cosine similarity. Nothing is downloaded.
"""

from __future__ import annotations

import argparse

import portlayer

QUERY = "How do I bake bread at home?"
DOCS = [
    "Knead the dough, let it rise for an hour, then bake at 220 degrees.",
    "The central bank raised interest rates again this quarter.",
    "A sourdough starter needs flour, water and a few days of patience.",
    "The match ended in a draw after extra time.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="auto")
    args = ap.parse_args()

    art = portlayer.compile("all-minilm-l6-v2", target=args.target, progress=False)
    print(art)
    model = art.load()
    report = model.validate()
    print(f"validation on {report.device}: {'PASSED' if report.ok else 'FAILED'}")

    emb = model.embed([QUERY, *DOCS]).float()
    emb = emb / emb.norm(dim=-1, keepdim=True)
    scores = (emb[1:] @ emb[0]).tolist()
    print(f"\nquery: {QUERY}")
    for score, doc in sorted(zip(scores, DOCS), reverse=True):
        print(f"  {score:6.3f}  {doc}")


if __name__ == "__main__":
    main()
