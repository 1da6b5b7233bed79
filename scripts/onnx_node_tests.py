"""Run every onnx.backend.test node test whose ops the ONNX import table maps; write the per-op table.

    PYTHONPATH=. python scripts/onnx_node_tests.py            # prints the table
    PYTHONPATH=. python scripts/onnx_node_tests.py --write    # also replaces it in docs/onnx.md

Single-node cases count towards their op; function-expanded cases (``*_expanded``, several ops)
are summed separately. A case fails with its reason (an unsupported dtype, a refused form, ...).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

BEGIN, END = "<!-- node-tests:begin -->", "<!-- node-tests:end -->"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true", help="replace the table in docs/onnx.md")
    args = ap.parse_args()
    import onnx

    from portlayer.flatten.onnx_conformance import collect, run_case
    from portlayer.flatten.onnx_import import mapped_ops

    t0 = time.time()
    mapped = set(mapped_ops())
    cases = [c for c in collect(None) if {n.op_type for n in c.model.graph.node} <= mapped]
    per_op: dict[str, list] = collections.defaultdict(list)
    expanded = []
    for c in cases:
        r = run_case(c)
        (per_op[c.model.graph.node[0].op_type] if len(c.model.graph.node) == 1 else expanded).append(r)
    lines = [f"onnx {onnx.__version__}: {len(cases)} node tests use only mapped ops "
             f"({time.time() - t0:.0f} s).", "", "| ONNX op | passed | failed | failures (reason) |", "|---|---|---|---|"]
    for op in sorted(mapped):
        rs = per_op.get(op, [])
        bad = [r for r in rs if not r.ok]
        why = "; ".join(f"`{r.name}`: {_short(r.reason)}" for r in bad[:6]) + (f"; ... {len(bad) - 6} more" if len(bad) > 6 else "")
        lines.append(f"| {op} | {len(rs) - len(bad)} | {len(bad)} | {why if rs else 'no node test of its own'} |")
    ok = sum(r.ok for r in expanded)
    lines += ["", f"Function-expanded cases built only of mapped ops: {ok} of {len(expanded)} pass."]
    bad = [r for r in expanded if not r.ok]
    lines += [f"- `{r.name}`: {_short(r.reason)}" for r in bad[:15]]
    table = "\n".join(lines)
    print(table)
    if args.write:
        doc = Path(__file__).resolve().parents[1] / "docs" / "onnx.md"
        text = doc.read_text()
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), BEGIN + "\n" + table.replace("\\", "\\\\") + "\n" + END,
                      text, flags=re.S)
        doc.write_text(text)
    return 0


def _short(reason: str) -> str:
    reason = re.sub(r"\(supported: \[.*", "", reason).replace("|", "/").strip()
    return reason[:110]


if __name__ == "__main__":
    sys.exit(main())
