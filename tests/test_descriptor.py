"""Descriptors: the shipped ten validate; malformed ones fail naming the JSON path and rule."""

from __future__ import annotations

import json
import sys

import pytest

from portlayer.capabilities.descriptor import (
    Descriptor,
    DescriptorError,
    deep_merge,
    list_descriptors,
    load_descriptor,
)

SHIPPED = [
    "cpu-x86_64", "nvidia-a100-80gb", "nvidia-h100-sxm", "nvidia-h200", "nvidia-rtx4060-laptop",
    "amd-mi300x", "amd-rx7900xtx", "intel-arc-a770", "intel-uhd-770", "ascend-910b",
]  # fmt: skip


def test_all_ten_shipped_descriptors_validate(validator):
    assert sorted(SHIPPED) == list_descriptors()
    for name in SHIPPED:
        d = load_descriptor(name)
        assert d.name == name
        assert d.raw["schema_version"] == 1
        assert len(d.sha256) == 64


@pytest.mark.parametrize("name", SHIPPED)
def test_every_number_has_a_source(name):
    d = load_descriptor(name)
    assert d.source("memory.bandwidth_gbps") != "no source given"
    assert d.source("throughput_tflops.fp32") != "no source given"


def test_views_and_features():
    h200 = load_descriptor("nvidia-h200")
    assert (h200.arch, h200.warp_size, h200.codegen) == ("sm_90", 32, "triton")
    assert h200.tflops("bfloat16") == h200.tflops("bf16") == 989.4
    assert h200.tflops("int4") is None  # absent means unsupported
    assert h200.has("tma") and not h200.has("paged_attention")
    assert h200.memory.capacity_bytes == 141 * 10**9
    assert load_descriptor("amd-mi300x").warp_size == 64
    igpu = load_descriptor("intel-uhd-770")
    assert igpu.memory.unified_with_host and igpu.tflops("bf16") is None
    with pytest.raises(AttributeError):
        h200.warp_size = 64  # frozen


def test_ascend_facts_from_the_reference():
    d = load_descriptor("ascend-910b")
    assert d.memory.alignment_bytes == 512
    assert d.kv_block_sizes == (128,)
    assert d.preferred_dtypes[0] == "float16"
    for feat in ("fused_add_rms_norm", "fused_rms_norm", "fused_rope", "fused_swiglu", "paged_attention",
                 "fused_reshape_and_cache", "weight_quant_matmul"):  # fmt: skip
        assert d.has(feat)
    assert d.vendor_ops["fused_add_rms_norm"] == "torch_npu.npu_add_rms_norm"
    assert "_npu_paged_attention" in d.vendor_ops["paged_attention"]
    assert "NPUCachingAllocator.cpp:97" in d.source("memory.alignment_bytes")
    assert "unconfirmed" in d.source("throughput_tflops")


def test_sha256_is_canonical_and_changes_with_content(tmp_path):
    raw = load_descriptor("nvidia-h200").raw
    p = tmp_path / "h200.json"
    p.write_text(json.dumps(raw, indent=7))  # different formatting, same content
    assert load_descriptor(p).sha256 == load_descriptor("nvidia-h200").sha256
    raw["memory"]["bandwidth_gbps"] = 4000
    assert Descriptor.from_dict(raw).sha256 != load_descriptor("nvidia-h200").sha256


def test_raw_is_a_copy():
    d = load_descriptor("nvidia-h200")
    d.raw["name"] = "mutated"
    assert d.raw["name"] == "nvidia-h200"


def test_unknown_name_lists_shipped():
    with pytest.raises(DescriptorError) as e:
        load_descriptor("nvidia-h900")
    assert "nvidia-h200" in str(e.value) and e.value.rule == "known_descriptor"


def _del(path):
    def f(d):
        *parents, last = path.split(".")
        node = d
        for p in parents:
            node = node[p]
        del node[last]

    return f


def _set(path, value):
    def f(d):
        *parents, last = path.split(".")
        node = d
        for p in parents:
            node = node[p]
        node[last] = value

    return f


MALFORMED = [
    # (mutation, expected json path, expected rule)
    (_del("name"), "$.name", "required"),
    (_del("memory.bandwidth_gbps"), "$.memory.bandwidth_gbps", "required"),
    (_del("sources"), "$.sources", "required"),
    (_del("compute_units.count"), "$.compute_units.count", "required"),
    (_del("dma"), "$.dma", "required"),
    (_set("memory.bandwidth_gbps", -5), "$.memory.bandwidth_gbps", "exclusiveMinimum"),
    (_set("memory.bandwidth_gbps", "fast"), "$.memory.bandwidth_gbps", "type"),
    (_set("memory.capacity_gb", 0), "$.memory.capacity_gb", "exclusiveMinimum"),
    (_set("device_type", "TPU v5"), "$.device_type", "pattern"),  # open data: any lowercase identifier
    (_set("codegen", "cuda_c"), "$.codegen", "known_codegen_family"),  # but the code family must exist
    (_set("throughput_tflops.fp32", float("nan")), "$.throughput_tflops.fp32", "finite"),
    (_set("memory.bandwidth_gbps", float("inf")), "$.memory.bandwidth_gbps", "finite"),
    (_set("schema_version", 2), "$.schema_version", "const"),
    (_set("warp_size", 32.5), "$.warp_size", "type"),
    (_set("warp_size", 0), "$.warp_size", "minimum"),
    (_set("warp_size", 48), "$.warp_size", "power_of_two"),
    (_set("memory.alignment_bytes", 300), "$.memory.alignment_bytes", "power_of_two"),
    (_set("memory.managed", "yes"), "$.memory.managed", "type"),
    (_set("memory_fence_scope", "grid"), "$.memory_fence_scope", "enum"),
    (_set("throughput_tflops.bf16", -1), "$.throughput_tflops.bf16", "exclusiveMinimum"),
    (_set("throughput_tflops.fp4", 10), "$.throughput_tflops.fp4", "additionalProperties"),
    (_set("bandwith", 1), "$.bandwith", "additionalProperties"),
    (_set("features", ["Tensor Cores"]), "$.features[0]", "pattern"),
    (_set("features", ["tma", "tma"]), "$.features", "uniqueItems"),
    (_set("name", "Bad Name"), "$.name", "pattern"),
    (_set("compute_units.count", -3), "$.compute_units.count", "minimum"),
    (_set("dma.engines", 1.5), "$.dma.engines", "type"),
    (_set("compute_units.max_shared_memory_per_block_bytes", 10**7), "$.compute_units.max_shared_memory_per_block_bytes", "le_shared_memory_per_unit"),
    (_set("vendor_ops", {"paged_attention": "x.y"}), "$.vendor_ops.paged_attention", "listed_in_features"),
    (_set("kv_cache", {"block_sizes": [100]}), "$.kv_cache.block_sizes[0]", "power_of_two"),
    (_set("sources", {"memory.bandwidth_gbps": "datasheet"}), "$.compute_units.clock_mhz", "has_source"),
    (lambda d: d["sources"].update({"memory.nonsense": "x"}), "$.sources.memory.nonsense", "names_a_field"),
    (_set("warp_sizes", [64]), "$.warp_size", "member_of_warp_sizes"),
    (_set("interconnect.peer_bandwidth_gbps", 0), "$.interconnect.peer_bandwidth_gbps", "exclusiveMinimum"),
]


def _apply(mutation):
    raw = load_descriptor("nvidia-h200").raw
    mutation(raw)
    return raw


@pytest.fixture(params=["jsonschema", "minischema"])
def validator(request, monkeypatch):
    """Run each case with jsonschema and with the fallback used where jsonschema is missing."""
    if request.param == "minischema":
        monkeypatch.setitem(sys.modules, "jsonschema", None)  # import now raises ImportError
    return request.param


@pytest.mark.parametrize("mutation,path,rule", MALFORMED, ids=[f"{p}:{r}" for _, p, r in MALFORMED])
def test_malformed_descriptor_names_path_and_rule(tmp_path, mutation, path, rule, validator):
    raw = _apply(mutation)
    f = tmp_path / "broken.json"
    f.write_text(json.dumps(raw))
    with pytest.raises(DescriptorError) as e:
        load_descriptor(f)
    err = e.value
    assert (err.path, err.rule) == (path, rule), str(err)
    msg = str(err)
    assert str(f) in msg and path in msg and rule in msg


def test_at_least_twenty_malformed_cases():
    assert len(MALFORMED) >= 20


def test_invalid_json_and_wrong_top_level(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text("{ not json")
    with pytest.raises(DescriptorError) as e:
        load_descriptor(f)
    assert e.value.rule == "valid_json" and "line 1" in str(e.value)
    f.write_text("[1, 2]")
    with pytest.raises(DescriptorError) as e:
        load_descriptor(f)
    assert e.value.rule == "type"
    with pytest.raises(DescriptorError) as e:
        load_descriptor(tmp_path / "missing.json")
    assert e.value.rule == "file_exists"


def test_deep_merge():
    assert deep_merge({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": 3}, "l": [2]}) == {"a": {"b": 3, "c": 2}, "l": [2]}
