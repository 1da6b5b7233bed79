"""The quality gate on tiny models: figures against an independent computation, GPTQ vs RTN on
held-out text, the default-pick fallback, and --strict."""

from __future__ import annotations

import math

import pytest
import torch

from portlayer.passes import quality_gate as Q


def test_compare_logits_matches_torch_kl_and_nll():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 11, generator=gen), torch.randn(6, 11, generator=gen)
    t = torch.randint(0, 11, (6,), generator=gen)
    r = Q.compare_logits(a, b, t)
    kl = torch.nn.functional.kl_div(torch.log_softmax(b.double(), -1), torch.log_softmax(a.double(), -1),
                                    log_target=True, reduction="sum")
    assert math.isclose(r["kl"], float(kl), rel_tol=1e-9)
    assert math.isclose(r["nll_q"], float(torch.nn.functional.cross_entropy(b.double(), t, reduction="sum")), rel_tol=1e-9)
    assert r["agree"] == float((a.argmax(-1) == b.argmax(-1)).sum())


def test_near_tie_flips_count_disagreements_where_the_float_top_two_are_close():
    ref = torch.tensor([[1.0, 0.95, 0.0], [2.0, 0.0, 1.0], [0.0, 3.0, 2.99], [5.0, 0.0, 0.0]])
    got = torch.tensor([[0.0, 1.0, 0.0], [0.0, 2.0, 0.0], [0.0, 3.0, 2.0], [0.0, 0.0, 1.0]])
    r = Q.compare_logits(ref, got, None)  # flips at rows 0 (gap 0.05), 1 (gap 1.0), 3 (gap 5.0)
    assert r["agree"] == 1.0 and r["near_tie_flips"] == 1.0


def test_gptq_beats_round_to_nearest_on_held_out_text(captured):
    from portlayer.passes.pipeline import run_pipeline

    g = captured["tiny-qwen3"]
    res = {m: run_pipeline(g, "cpu-x86_64", overrides={"weight_quantization": "int4"}, options={"quant_method": m})
           for m in ("rtn", "gptq")}
    kl = {m: Q.gate(g, r.graph, "int4").mean_kl for m, r in res.items()}
    assert kl["gptq"] < kl["rtn"], kl
    same = Q.gate(g, g, "int8")
    assert same.passed and same.top1 == 1.0 and same.mean_kl < 1e-12 and abs(same.ppl_ratio - 1) < 1e-12


def test_default_pick_below_threshold_falls_back_with_the_measured_reason(captured, monkeypatch):
    from portlayer.capabilities.policy import plan_for_graph
    from portlayer.passes.gated import run_gated

    g = captured["tiny-qwen3"]
    assert plan_for_graph(g, "nvidia-a100-80gb").weight_quantization == "int4"  # the policy's own default pick
    monkeypatch.setitem(Q.THRESHOLDS, "int4", Q.Thresholds(top1=1.01, mean_kl=0.0, ppl_ratio=1.0))  # cannot pass
    monkeypatch.setitem(Q.THRESHOLDS, "int8", Q.Thresholds(top1=0.0, mean_kl=math.inf, ppl_ratio=math.inf))  # always
    out = run_gated(g, "nvidia-a100-80gb")
    d = out.result.plan.decision("weight_quantization")
    assert [r.mode for r in out.rejected] == ["int4"] and d.value == "int8" and out.gate.passed
    assert "rejected by the quality gate (measured top-1" in d.reason and "top-1 agreement" in d.reason
    assert {n.attrs["bits"] for n in out.result.graph.find("linear_wq")} == {8}


def test_explicit_quantize_below_threshold_warns_or_is_refused(tiny_dirs, monkeypatch):
    import portlayer
    from portlayer.api import CompileError

    monkeypatch.setitem(Q.THRESHOLDS, "int4", Q.Thresholds(top1=1.01, mean_kl=0.0, ppl_ratio=1.0))
    with pytest.raises(CompileError, match="refused .--strict.: --quantize int4 is below"):
        portlayer.compile(tiny_dirs["tiny-qwen3"], target="cpu-x86_64", quantize="int4", strict=True, progress=False)
    art = portlayer.compile(tiny_dirs["tiny-qwen3"], target="cpu-x86_64", quantize="int4", progress=False)
    doc = art.manifest.raw["quality_gate"]
    assert doc["explicit"] and not doc["compiled"]["passed"] and "below the quality gate" in doc["warning"]
    assert art.load().plan.weight_quantization == "int4"


def test_gptq_with_identity_hessian_is_round_to_nearest_and_lowers_layer_error():
    from portlayer.passes.gptq import gptq, rtn

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=gen) * 0.05
    for bits, g, sym in ((4, 128, False), (8, 256, True), (4, 64, True)):
        q1, s1, o1 = rtn(w, bits, g, sym)
        q2, s2, o2 = gptq(w, torch.eye(256, dtype=torch.float64), 1, bits, g, sym, damp=0.0)
        assert torch.equal(q1, q2) and torch.equal(s1, s2)
    # correlated inputs: GPTQ's output error ||X (W - Wq)^T|| is below round-to-nearest's
    x = torch.randn(512, 32, generator=gen) @ torch.randn(32, 256, generator=gen)
    q, s, o = gptq(w, x.T.double() @ x.double(), 512, 4, 128, False)
    qr, sr, orr = rtn(w, 4, 128, False)

    def deq(q, s, o):
        return (q.float().reshape(48, 2, 128) * s[:, :, None] + o[:, :, None]).reshape(48, 256)

    assert (x @ (w - deq(q, s, o)).T).norm() < 0.8 * (x @ (w - deq(qr, sr, orr)).T).norm()


def test_calibrated_clip_beats_round_to_nearest_sequential_or_not(captured):
    """The int4 default (output-error clip search, true-sequential) and its float-calibrated
    variant both grade better than plain round-to-nearest on the held-out text."""
    from portlayer.passes.pipeline import run_pipeline

    g = captured["tiny-qwen3"]
    opts = {"rtn": {"quant_method": "rtn"}, "seq": {}, "float": {"sequential": False}}
    res = {k: run_pipeline(g, "cpu-x86_64", overrides={"weight_quantization": "int4"}, options=o) for k, o in opts.items()}
    assert "output-error clip, sequential" in res["seq"].graph.meta["quantization"]["method"]
    kl = {k: Q.gate(g, r.graph, "int4").mean_kl for k, r in res.items()}
    assert kl["seq"] < kl["rtn"] and kl["float"] < kl["rtn"], kl


def test_calibration_device_reaches_the_quantize_pass_and_the_gate(captured, monkeypatch):
    """run_gated(device=...) hands the device to the quantize pass (its calibration_device) and to the gate; the
    result on an explicit cpu is the default's (same codes, same gate figures)."""
    import portlayer.passes.gated as G
    import portlayer.passes.quantize as QZ

    g = captured["tiny-qwen3"]
    seen: dict[str, list] = {"pass": [], "gate": []}
    real_calibrated, real_gate = QZ._calibrated, G.gate

    def calibrated(graph, ctx, *a, **k):
        seen["pass"].append(ctx.options.get("calibration_device"))
        return real_calibrated(graph, ctx, *a, **k)

    def gate(*a, **k):
        seen["gate"].append(k.get("device"))
        return real_gate(*a, **k)

    monkeypatch.setattr(QZ, "_calibrated", calibrated)
    monkeypatch.setattr(G, "gate", gate)
    ov = {"weight_quantization": "int4"}
    explicit = G.run_gated(g, "cpu-x86_64", ov, device="cpu")
    default = G.run_gated(g, "cpu-x86_64", ov)
    assert seen == {"pass": ["cpu", None], "gate": ["cpu", "cpu"]}
    assert explicit.gate.top1 == default.gate.top1 and explicit.gate.mean_kl == default.gate.mean_kl
    for name in explicit.result.graph.weights:
        assert torch.equal(explicit.result.graph.weights[name], default.result.graph.weights[name]), name


def test_a_calibration_device_this_machine_lacks_is_a_clear_compile_error(tiny_dirs):
    """`portlayer compile --calibration-device cuda` without a GPU (or a device that is not one) says so, naming
    the flag, with no traceback."""
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    for dev, says in (("cuda", "no CUDA device"), ("gpu0", "is not a device")):
        r = subprocess.run([sys.executable, "-m", "portlayer.cli", "compile", str(tiny_dirs["tiny-qwen3"]), "--target",
                            "cpu-x86_64", "--quantize", "int4", "--calibration-device", dev, "--no-progress"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and "--calibration-device" in r.stderr and says in r.stderr, r.stderr[-800:]
        assert "Traceback" not in r.stderr
