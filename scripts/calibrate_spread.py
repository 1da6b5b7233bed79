"""Spread between two calibrated descriptors: every number both measured, |a - b| / mean in %.

    python scripts/calibrate_spread.py cal1.json cal2.json
"""

from __future__ import annotations

import json
import sys
from typing import Any


def numbers(d: dict[str, Any]) -> dict[str, float]:
    """The measured numbers of one calibrated descriptor, by a readable name."""
    c = d["calibration"]
    out: dict[str, float | None] = {"copy GB/s (largest)": d["memory"]["bandwidth_gbps"],
                                    "launch eager us": c["launch_us"].get("eager_us"),
                                    "launch graph us": c["launch_us"].get("graph_us"),
                                    "launch generated kernel us": c["launch_us"].get("triton_us")}
    out.update({f"sweep copy {r['bytes'] // 1024} KiB GB/s": r["copy_gbps"] for r in c["bandwidth_sweep"]})
    out.update({f"matmul {k} TFLOP/s": v for k, v in d["throughput_tflops"].items()})
    attn = c.get("attention") or {}
    out.update({f"attention b{p['batch']} ctx{p['context']} us": p["us"] for p in attn.get("points", [])})
    for name in ("gemm_curves", "gemm_curves_small"):
        for k, curve in (c.get(name) or {}).items():
            out.update({f"{name.replace('gemm_curves', 'gemm')} {k} M={r['m']} us": r["us"] for r in curve})
    for a in c.get("gemm_aspects") or []:
        out.update({f"gemm K={a['k']} N={a['n']} M={r['m']} us": r["us"] for r in a["points"]})
    for p in (c.get("gemm_crossover") or {}).get("points", []):
        for path in ("triton", "vendor", "gemv"):
            if f"{path}_us" in p:
                out[f"crossover {path} M={p['m']} us"] = p[f"{path}_us"]
    for op, v in (c.get("torch_nodes") or {}).items():
        out[f"node {op} us"], out[f"node {op} big us"] = v["us"], v["big_us"]
    return {k: float(v) for k, v in out.items() if isinstance(v, (int, float))}


def spread_table(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    na, nb = numbers(a), numbers(b)
    rows = [{"name": k, "a": na[k], "b": nb[k], "spread_pct": abs(na[k] - nb[k]) / ((na[k] + nb[k]) / 2) * 100}
            for k in na if k in nb and na[k] + nb[k] > 0]
    return {"rows": rows, "worst_pct": max((r["spread_pct"] for r in rows), default=0.0),
            "within_10pct": sum(r["spread_pct"] <= 10 for r in rows), "count": len(rows),
            "threads": [a["calibration"].get("threads"), b["calibration"].get("threads")]}


if __name__ == "__main__":
    t = spread_table(*(json.load(open(p)) for p in sys.argv[1:3]))
    for r in sorted(t["rows"], key=lambda r: -r["spread_pct"]):
        print(f"  {r['name']:<40} {r['a']:>11.4g} {r['b']:>11.4g} {r['spread_pct']:6.1f}%")
    print(f"worst {t['worst_pct']:.1f}%, {t['within_10pct']}/{t['count']} within 10%")
