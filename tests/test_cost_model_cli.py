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
    assert "predicted vs measured (cpu-x86_64, descriptor peaks; measured: " in text
    report = json.loads(out.read_text())
    rows = {r["step"]: r for r in report["predicted"]}
    assert set(rows) == {"prefill 8 tok", "decode batch 1", "decode batch 3"}
    # one-thread CPU runs are compared with their process CPU time (cpu_ms), others with the wall median
    pick = lambda row, wall: row["cpu_ms"] if report["threads"] == 1 else row[wall]  # noqa: E731
    measured = {"prefill 8 tok": pick(report["prefill"], "latency_ms"),
                **{f"decode batch {d['batch']}": pick(d, "step_ms") for d in report["decode"]}}  # fmt: skip
    for step, r in rows.items():
        assert r["measured_ms"] == measured[step] and r["predicted_ms"] > 0
        assert abs(r["error_pct"] - 100 * (r["predicted_ms"] / r["measured_ms"] - 1)) < 1e-6


def test_bench_takes_cpu_time_with_one_thread(tmp_path):
    """With one torch thread the CPU time of a step is what it costs, whatever else the host runs."""
    import torch

    import portlayer
    from portlayer.bench import bench
    from portlayer.capabilities.calibrate_timing import pinned_threads

    art = portlayer.compile(tiny_decoder(), target="cpu-x86_64", output=tmp_path / "art", progress=False).path
    with pinned_threads(1):
        r = bench(portlayer.load(art), prefill_tokens=8, context=8, batch_sizes=(1,), warmup=1, iters=2, rounds=2)
    assert r["threads"] == 1 and r["rounds"] == 2
    for row in (r["prefill"], r["decode"][0]):
        assert 0 < row["cpu_ms"] and row["min_ms"] <= row.get("latency_ms", row.get("step_ms"))
    with pinned_threads(2):
        if torch.get_num_threads() == 2:  # several threads: no CPU-time figure (idle workers spin)
            r2 = bench(portlayer.load(art), prefill_tokens=8, context=8, batch_sizes=(1,), warmup=0, iters=1, rounds=1)
            assert "cpu_ms" not in r2["prefill"]
