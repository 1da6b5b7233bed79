"""Tuning files: keyed by descriptor identity and toolchain, used by the Plan, refused when made elsewhere."""

from __future__ import annotations

import json

import pytest

from portlayer.capabilities.descriptor import load_descriptor
from portlayer.capabilities.policy import ModelRequirements, negotiate
from portlayer.capabilities.tuning import TuningError, TuningFile, default_path, shape_key, toolchain

CONFIG = {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
          "num_hidden_layers": 2, "vocab_size": 1000, "intermediate_size": 3072}  # fmt: skip
TUNED_GEMM = {"num_warps": 4, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 3}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PORTLAYER_CACHE", str(tmp_path))
    monkeypatch.delenv("PORTLAYER_TUNING", raising=False)
    return tmp_path


def _req() -> ModelRequirements:
    return ModelRequirements.from_hf_config(dict(CONFIG), name="qwen3-shape")


def _file(name: str = "nvidia-h200", tools: dict | None = None, config: dict | None = None) -> TuningFile:
    d = load_descriptor(name)
    f = TuningFile(d.name, d.sha256, dict(tools or toolchain()))
    default = negotiate(_req(), "nvidia-h200").value("launch.gemm")
    f.put("gemm", shape_key(_req(), "bfloat16"), config or TUNED_GEMM, 10.0, 12.5, default, 6)
    return f


def test_no_file_keeps_the_defaults(cache):
    a = negotiate(_req(), "nvidia-h200")
    assert not (cache / "tuning").exists()
    assert "tuned" not in a.decision("launch.gemm").reason


def test_tuned_entry_feeds_the_plan(cache):
    d = load_descriptor("nvidia-h200")
    default = negotiate(_req(), d).value("launch.gemm")
    assert default != TUNED_GEMM
    path = _file().save(default_path(d.name, d.sha256))
    plan = negotiate(_req(), d)
    dec = plan.decision("launch.gemm")
    assert dec.value == TUNED_GEMM
    assert dec.reason.startswith("tuned: entry gemm@bfloat16:h1024:i3072:q16:kv8:d128") and str(path) in dec.reason
    other = plan.decision("launch.reduction")  # no entry for that family: the default, said why
    assert "default" in other.reason and "has no entry reduction@" in other.reason


def test_entry_for_another_shape_is_not_used(cache):
    d = load_descriptor("nvidia-h200")
    _file().save(default_path(d.name, d.sha256))
    req = ModelRequirements.from_hf_config({**CONFIG, "hidden_size": 2048}, name="wider")
    assert negotiate(req, d).value("launch.gemm") != TUNED_GEMM


def test_file_from_another_device_is_refused(cache, tmp_path, monkeypatch):
    p = _file("nvidia-h100-sxm").save(tmp_path / "h100.json")
    monkeypatch.setenv("PORTLAYER_TUNING", str(p))
    with pytest.raises(TuningError, match="tuned for device descriptor nvidia-h100-sxm.*targets nvidia-h200"):
        negotiate(_req(), "nvidia-h200")


def test_file_from_another_toolchain_is_refused(cache, tmp_path, monkeypatch):
    d = load_descriptor("nvidia-h200")
    old = {"torch": "2.0.0", "triton": "2.1.0"}
    p = _file(tools=old).save(tmp_path / "old.json")
    monkeypatch.setenv("PORTLAYER_TUNING", str(p))
    with pytest.raises(TuningError, match=r"tuned with torch 2\.0\.0, triton 2\.1\.0; this toolchain is torch"):
        negotiate(_req(), d)
    monkeypatch.delenv("PORTLAYER_TUNING")  # copied into the default place: refused, defaults used, said so
    _file(tools=old).save(default_path(d.name, d.sha256))
    dec = negotiate(_req(), d).decision("launch.gemm")
    assert dec.value != TUNED_GEMM and "tuning file refused" in dec.reason


def test_new_toolchain_gets_its_own_file():
    d = load_descriptor("nvidia-h200")
    a = default_path(d.name, d.sha256, {"torch": "2.11", "triton": "3.6"})
    b = default_path(d.name, d.sha256, {"torch": "2.11", "triton": "3.7"})
    assert a != b and a.parent == b.parent


@pytest.mark.parametrize("bad", [
    {"format": "something-else"},
    {"entries": {"gemm@x": {"config": {"BLOCK_M": "64"}, "time_us": 1, "default_us": 2}}},
    {"entries": {"gemm@x": {"config": {"BLOCK_M": 10**9}, "time_us": 1, "default_us": 2}}},
    {"toolchain": "torch"},
])  # fmt: skip
def test_malformed_file_is_refused(cache, tmp_path, monkeypatch, bad):
    raw = _file().to_json()
    raw.update(bad)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(raw))
    monkeypatch.setenv("PORTLAYER_TUNING", str(p))
    with pytest.raises(TuningError, match="bad.json"):
        negotiate(_req(), "nvidia-h200")


def test_entry_with_other_parameters_is_not_used(cache):
    d = load_descriptor("nvidia-h200")
    _file(config={"num_warps": 4, "BLOCK": 64}).save(default_path(d.name, d.sha256))
    dec = negotiate(_req(), d).decision("launch.gemm")
    assert dec.value != {"num_warps": 4, "BLOCK": 64} and "the kernel takes" in dec.reason


@pytest.mark.parametrize("target", ["nvidia-h200", "amd-mi300x", "nvidia-rtx4060-laptop"])
def test_candidates_stay_inside_what_the_descriptor_allows(target):
    from portlayer.capabilities.tuning_space import ITEMSIZE, candidates

    d = load_descriptor(target)
    plan = negotiate(_req(), d)
    item = ITEMSIZE[plan.compute_dtype]
    smem = d.compute_units.max_shared_memory_per_block_bytes or d.compute_units.shared_memory_per_unit_bytes
    for dec in plan:
        if not dec.name.startswith("launch.") or not dec.value:
            continue
        cands = candidates(dec.name.removeprefix("launch."), dec.value, d, plan.compute_dtype)
        assert cands[0] == dec.value and 1 <= len(cands) <= 6
        assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)  # no duplicates
        for c in cands:
            assert set(c) == set(dec.value)  # the kernel's parameters, no others
            assert c["num_warps"] * d.warp_size <= min(1024, d.compute_units.max_threads_per_unit)
            if dec.name == "launch.gemm" and c != dec.value:
                assert c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * item <= smem
            if dec.name == "launch.attention_prefill":
                assert c["BLOCK_N"] == dec.value["BLOCK_N"] and c["BLOCK_D"] == dec.value["BLOCK_D"]
            if dec.name == "launch.attention_decode":  # whole tl.dot tiles, K + V stages within shared memory
                assert c["TILE"] >= 16 * c["BLOCK_D"] and c["BLOCK_D"] == dec.value["BLOCK_D"]
                assert c == dec.value or c["num_stages"] * 2 * c["TILE"] * item <= smem
            if dec.name in ("launch.reduction", "launch.embedding"):
                assert c["BLOCK_N"] == dec.value["BLOCK_N"]  # a row kernel covers its whole row
            if dec.name == "launch.gemv_wq":  # PDL_TRIGGER is 1 or 2, and only varies where the device has PDL
                assert c["PDL_TRIGGER"] in (1, 2)
                assert d.has("programmatic_dependent_launch") or c["PDL_TRIGGER"] == dec.value["PDL_TRIGGER"]
        if dec.name == "launch.gemv_wq" and d.has("programmatic_dependent_launch"):
            assert {c["PDL_TRIGGER"] for c in cands} == {1, 2}


def test_cache_key_suffix_follows_the_tuning_file(cache):
    from portlayer.capabilities.tuning import tuning_digest

    d = load_descriptor("nvidia-h200")
    assert tuning_digest(d) == ""  # no file: compile cache keys as before
    p = _file().save(default_path(d.name, d.sha256))
    first = tuning_digest(d)
    f = _file()
    f.put("reduction", "x", {"num_warps": 2}, 1.0, 2.0, {"num_warps": 4}, 2)
    f.save(p)
    assert first.startswith(":tuning-") and tuning_digest(d) != first


@pytest.mark.parametrize("model,quant", [("tiny-qwen3", None), ("tiny-gpt2", None), ("tiny-qwen3", "int4")])
def test_every_generated_kernel_is_found_by_its_launch_familys_prefix(captured, model, quant):
    """The tuner compares a family's configs by the device time of the kernels whose names carry that
    family's prefix (backends/tuning_runner.family_kernel): every kernel of a generated program must
    be found under exactly one launch family the plan has, the one whose config it was generated with
    (int4: the quantized GEMVs without a fused norm under gemv_wq, the norm-fused ones under gemv),
    or its family could not be tuned."""
    from portlayer.backends.generate import generate
    from portlayer.backends.tuning_runner import family_kernel
    from portlayer.passes.pipeline import run_pipeline

    res = run_pipeline(captured[model], "nvidia-h200", verify=False,
                       overrides={"weight_quantization": quant} if quant else None)
    families = [d.name.removeprefix("launch.") for d in res.plan if d.name.startswith("launch.") and d.value]
    gen = generate(res.graph, res.plan, res.descriptor)
    assert gen.kernels
    seen = set()
    for spec in gen.kernels.values():
        owners = [f for f in families if family_kernel(spec.fn, f)]
        assert len(owners) == 1, (spec.fn, owners)
        if spec.family in ("gemv", "gemv_wq"):  # the few-rows kernels: found under the config they were made with
            assert owners == [spec.family], (spec.fn, owners)
        seen.add(spec.family)
    if quant:  # both quantized few-rows forms are in the program, each under its own config
        assert {"gemv", "gemv_wq"} <= seen, seen
        wq = [s for s in gen.kernels.values() if s.family == "gemv_wq"]
        assert all(s.num_warps == res.plan.launch_config("gemv_wq")["num_warps"] for s in wq)


def test_descriptor_launch_defaults_replace_the_rule_and_a_tuning_file_still_wins(cache):
    """The H200 descriptor ships launch parameters measured on that device (tuning.launch_defaults); the
    plan takes them over the rule-derived ones and says so, and a tuning file made by `portlayer tune`
    on the host replaces them in turn."""
    d = load_descriptor("nvidia-h200")
    measured = d.tuning["launch_defaults"]
    plan = negotiate(_req(), d)
    for fam, params in measured.items():
        dec = plan.decision(f"launch.{fam}")
        assert {k: dec.value[k] for k in params} == params
        assert "descriptor tuning.launch_defaults" in dec.reason
    tuned = {**plan.value("launch.gemm"), "BLOCK_M": 64, "BLOCK_N": 64}
    _file(config=tuned).save(default_path(d.name, d.sha256))
    assert negotiate(_req(), d).value("launch.gemm") == tuned


@pytest.mark.parametrize("bad, match", [({"gemv_joint": {"TILE": 8192}}, "not a kernel family"),
                                        ({"gemv": {"TILES": 8192}}, "do not take")])
def test_descriptor_launch_defaults_naming_what_no_kernel_takes_is_refused(tmp_path, bad, match):
    import copy

    from portlayer.capabilities.descriptor import Descriptor, DescriptorError

    raw = copy.deepcopy(dict(load_descriptor("nvidia-h200").raw))
    raw["tuning"]["launch_defaults"] = bad
    d = Descriptor.from_dict(raw, origin=str(tmp_path / "mine.json"))
    with pytest.raises(DescriptorError, match=match) as e:
        negotiate(_req(), d)
    assert "mine.json" in str(e.value) and "tuning.launch_defaults" in str(e.value)


def test_a_user_override_of_a_launch_config_stands_over_the_descriptors_measured_one(cache):
    """--override launch.gemv=...: the user's config is used as given, not patched with the descriptor's
    tuning.launch_defaults, and a partial one is not blamed on the shipped descriptor."""
    d = load_descriptor("nvidia-h200")
    mine = {"num_warps": 4, "TILE": 4096, "PROGRAMS": 264, "num_stages": 1}
    plan = negotiate(_req(), d, {"launch.gemv": mine, "launch.attention_decode": {"num_warps": 4}})
    assert plan.value("launch.gemv") == mine and plan.decision("launch.gemv").reason.startswith("user override")
    assert plan.value("launch.attention_decode") == {"num_warps": 4}


def test_busy_time_counts_overlapping_kernels_once_and_skips_idle_gaps():
    from portlayer.backends.tuning_runner import busy_us

    # PDL: the second kernel starts before the first ends; a host gap (30-40) is not device time
    assert busy_us([(0.0, 10.0), (5.0, 12.0), (11.0, 11.5), (40.0, 45.0), (30.0, 30.0)]) == 17.0
    assert busy_us([(2.0, 4.0), (0.0, 1.0)]) == 3.0 and busy_us([]) == 0.0


@pytest.mark.parametrize("target", ["nvidia-h200", "amd-mi300x"])
def test_a_pdl_trigger_is_tuned_by_the_whole_steps_where_the_device_has_pdl(target):
    """launch.gemv_wq's PDL_TRIGGER changes when the kernel after it starts, which its own kernel time cannot show:
    on a PDL device its candidates are compared by the steps' device time; every other family by its own kernels."""
    from portlayer.backends.tuning_runner import whole_step_metric

    d = load_descriptor(target)
    plan = negotiate(_req(), d)
    wq = plan.value("launch.gemv_wq")
    assert wq["PDL_TRIGGER"] == 2
    assert whole_step_metric("gemv_wq", wq, d) is d.has("programmatic_dependent_launch")
    assert not any(whole_step_metric(x.name.removeprefix("launch."), x.value, d) for x in plan
                   if x.name.startswith("launch.") and x.value and x.name != "launch.gemv_wq")


class _FakeTimer:
    """StepTimer's interface with made-up times: gemv_wq's own kernels get faster with BLOCK_N 8, and the whole
    steps faster with PDL_TRIGGER 2 (what the H200 measured); ``pdl``: whether binaries with PDL were launched."""

    pdl_binaries = True

    def __init__(self, *args, **kwargs):
        self.device = type("D", (), {"type": "cuda"})()
        self.launches: dict[str, int] = {}
        self.pdl = False
        self.calls: list[tuple[dict, bool]] = []

    def __call__(self, launch, family=None, whole_steps=False):
        cfg = launch[family]
        self.calls.append((dict(cfg), whole_steps))
        self.launches[family] = 56
        self.pdl = self.pdl_binaries
        if whole_steps:
            return 1000.0 if cfg["PDL_TRIGGER"] == 2 else 1300.0
        return 150.0 if cfg["BLOCK_N"] == 8 else 200.0


@pytest.mark.parametrize("pdl_binaries", [True, False])
def test_the_pdl_trigger_is_chosen_by_whole_steps_after_the_other_parameters(cache, monkeypatch, pdl_binaries):
    """The trigger-only candidate is left out of the own-kernel comparison; the winner of that is then compared with
    its other trigger over whole steps, only when the kernels launched under PDL (else both are one kernel)."""
    from portlayer.backends import tuning_runner

    class Timer(_FakeTimer):
        pass

    Timer.pdl_binaries = pdl_binaries
    made: list[Timer] = []
    monkeypatch.setattr(tuning_runner, "StepTimer", lambda *a, **k: made.append(Timer()) or made[-1])
    d = load_descriptor("nvidia-h200")
    plan = negotiate(_req(), d)
    default = plan.value("launch.gemv_wq")
    graph = type("G", (), {"meta": {"kernels": [{"family": "gemm"}]}, "find": lambda self, op: [1]})()
    lines: list[str] = []
    f = tuning_runner.tune(graph, plan, d, "cuda", batch=[1], families=["gemv_wq"], say=lines.append)
    (entry,) = f.entries.values()
    first = [c for c, whole in made[0].calls if not whole]
    assert all(c["PDL_TRIGGER"] == default["PDL_TRIGGER"] for c in first)  # no trigger-only candidate in phase 1
    assert entry["config"]["BLOCK_N"] == 8
    if pdl_binaries:
        assert [c["PDL_TRIGGER"] for c, whole in made[0].calls if whole] == [2, 1]
        assert entry["config"]["PDL_TRIGGER"] == 2
    else:
        assert entry["config"]["PDL_TRIGGER"] == default["PDL_TRIGGER"]
        assert any("PDL_TRIGGER not compared" in m for m in lines)
