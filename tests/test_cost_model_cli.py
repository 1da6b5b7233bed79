"""`portlayer bench` prints the cost model's prediction beside every step it measures."""

from __future__ import annotations

import json

from ir_samples import tiny_decoder


def test_bench_prints_predicted_beside_measured(tmp_path, capsys):
    import portlayer
    from portlayer.cli import main

    art = portlayer.compile(tiny_decoder(), target="cpu-x86_64", output=tmp_path / "art", progress=False).path
    out = tmp_path / "bench.json"
    assert main(["bench", str(art), "--batch", "1", "3", "--iters", "2", "--prefill-tokens", "8", "--context", "8",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predicted vs measured (cpu-x86_64, descriptor peaks)" in text
    report = json.loads(out.read_text())
    rows = {r["step"]: r for r in report["predicted"]}
    assert set(rows) == {"prefill 8 tok", "decode batch 1", "decode batch 3"}
    measured = {"prefill 8 tok": report["prefill"]["latency_ms"],
                **{f"decode batch {d['batch']}": d["step_ms"] for d in report["decode"]}}  # fmt: skip
    for step, r in rows.items():
        assert r["measured_ms"] == measured[step] and r["predicted_ms"] > 0
        assert abs(r["error_pct"] - 100 * (r["predicted_ms"] / r["measured_ms"] - 1)) < 1e-6
