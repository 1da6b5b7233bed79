"""Compile one model for every shipped descriptor and show where the plans differ, side by side.

    python examples/compile_for_every_target.py [MODEL] [-o DIR]

A different descriptor gives a different but explainable plan: this prints each decision
whose value differs between targets, one column per target, then what each target's
artifact holds (generated sources, once codegen for that family exists). Compiling for a
device you do not have works; loading the artifact there is what checks the device.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import portlayer
from portlayer.capabilities.descriptor import list_descriptors
from portlayer.capabilities.plan import format_value


def compact(name: str, value: object) -> str:
    """Launch configs as 'nw4 BM64 …' (initials of each key) so ten columns fit a screen."""
    if isinstance(value, dict):
        return " ".join("".join(w[0] for w in k.split("_")) + str(v) for k, v in value.items()) or "-"
    return format_value(name, value)


def side_by_side(plans: dict[str, object], width: int = 14) -> str:
    names = list(plans)
    decisions = [d.name for d in next(iter(plans.values())).decisions]
    rows = []
    for dec in decisions:
        values = [compact(dec, p.value(dec)) if dec in p.names() else "-" for p in plans.values()]
        if len(set(values)) > 1:
            rows.append([dec, *values])
    head = ["decision", *[n[:width] for n in names]]
    w0 = max(len(r[0]) for r in [head, *rows])
    fmt = lambda r: f"{r[0]:<{w0}} " + " ".join(f"{str(c)[:width]:>{width}}" for c in r[1:])  # noqa: E731
    return "\n".join([fmt(head), "-" * len(fmt(head)), *map(fmt, rows)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="tiny-qwen3")
    ap.add_argument("-o", "--output", default=None, help="directory for the artifacts (default: a temp dir)")
    args = ap.parse_args()
    root = Path(args.output or tempfile.mkdtemp(prefix="portlayer-targets-"))

    plans, arts = {}, {}
    for name in list_descriptors():
        art = portlayer.compile(args.model, target=name, output=root / name, progress=False)
        loaded = portlayer.load(art.path, check_device=False)  # inspect only: most targets are not here
        plans[name], arts[name] = loaded.plan, loaded
        print(f"{name:<24} {art.seconds:5.1f} s  -> {art.path}")

    print(f"\ndecisions that differ between targets ({args.model}):\n")
    print(side_by_side(plans))

    print("\nwhat each artifact holds:")
    for name, loaded in arts.items():
        m = loaded.manifest
        sources = m.files_of("source")
        how = m.raw.get("stages", {})
        print(f"  {name:<24} {len(m.files)} files, {len(sources)} generated sources"
              f"{': ' + ', '.join(sources[:4]) + (' ...' if len(sources) > 4 else '') if sources else ''}")
        print(f"  {'':<24} passes: {str(how.get('passes'))[:60]}; codegen: {str(how.get('codegen'))[:70]}")


if __name__ == "__main__":
    main()
