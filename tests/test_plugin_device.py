"""A plugin adds a device type portlayer never shipped, and a model compiles and runs through it.

The fixture package (tests/fixtures/portlayer_fake_backend) is pip-installed into a temp
dir; it serves device_type 'fakeaccel' with its own descriptor, probe and codegen family.
Tokens are checked against HF generate on the same weights.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from portlayer.backends import registry
from portlayer.capabilities import plugins, probe
from portlayer.capabilities.descriptor import DescriptorError, load_descriptor
from portlayer.capabilities.plan import Plan

FIXTURE = Path(__file__).parent / "fixtures" / "portlayer_fake_backend"


def _forget_plugins() -> None:
    plugins._entry_points.cache_clear()
    probe._probe_all.cache_clear()
    sys.modules.pop("portlayer_fake_backend", None)


@pytest.fixture(scope="module")
def fake_plugin(tmp_path_factory):
    registry.load_backends()  # built-ins, before the plugin is importable: the registry we copy and restore
    target = tmp_path_factory.mktemp("plugin") / "site"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(FIXTURE)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(target))
        importlib.invalidate_caches()
        mp.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
        mp.setattr(registry, "_ORIGINS", dict(registry._ORIGINS))
        mp.setattr(plugins, "_DECLARED", dict(plugins._DECLARED))
        _forget_plugins()
        with pytest.warns(RuntimeWarning, match="brokenaccel.*failed to load"):
            registry.load_backends(refresh=True)
        yield sys.modules["portlayer_fake_backend"].FakeAccelAdapter
        _forget_plugins()


def test_plugin_device_type_descriptor_probe_and_adapter(fake_plugin):
    desc = load_descriptor("fakeaccel-1")  # found by name among the plugin's descriptor files
    assert (desc.device_type, desc.codegen, desc.arch) == ("fakeaccel", "torch", "fake1")
    found = [d for d in probe.probe_devices() if d.device_type == "fakeaccel"]
    assert len(found) == 1 and found[0].usable and Path(found[0].descriptor).name == "fakeaccel-1.json"
    adapter = registry.get_backend(desc)
    assert isinstance(adapter, fake_plugin) and adapter.name == "fakeaccel"
    assert not adapter.supports_graph_capture()
    buf = adapter.allocate(100)
    assert buf.data_ptr() % 128 == 0 and buf.numel() == 128  # the plugin descriptor's alignment


def test_a_model_compiles_and_generates_through_the_plugin(fake_plugin, tiny_dirs, tmp_path, capsys):
    from conftest import hf_model

    from portlayer.cli import main
    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.sequence import SamplingParams

    path = tiny_dirs["tiny-qwen3"]
    art_dir = tmp_path / "art"
    compiled, loaded = fake_plugin.compiled, fake_plugin.loaded
    capsys.readouterr()
    assert main(["compile", str(path), "--target", "fakeaccel-1", "-o", str(art_dir), "--no-progress"]) == 0
    out = capsys.readouterr().out
    m = json.loads((art_dir / "manifest.json").read_text())
    t = m["timings_s"]  # the summary prints the stage split the manifest records
    assert f"time: capture {t['capture']:.2f} s, passes {t['passes']:.2f} s, codegen {t['codegen']:.2f} s" in out
    assert m["target"]["device_type"] == "fakeaccel" and m["target"]["backend"] == "fakeaccel"
    assert m["stages"]["codegen"] == "FakeAccelAdapter.compile_program" and fake_plugin.compiled == compiled + 1
    plan = Plan.from_json(json.loads((art_dir / "plan.json").read_text()))
    assert plan.value("graph_capture_sizes") == [] and plan.target == "fakeaccel-1"  # its descriptor claims none

    allocations = fake_plugin.allocations
    eng = LLMEngine.from_artifact(art_dir)
    assert fake_plugin.loaded == loaded + 1 and fake_plugin.allocations > allocations  # KV cache from the adapter
    prompt = [9, 8, 7, 6, 5]
    out = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    ids = torch.tensor([prompt])
    ref = hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == ref


def test_codegen_family_must_exist(tmp_path, monkeypatch):
    raw = load_descriptor("cpu-x86_64").raw
    raw.update(name="mydev", device_type="mydev", codegen="mygen")
    f = tmp_path / "mydev.json"
    f.write_text(json.dumps(raw))
    with pytest.raises(DescriptorError) as e:
        load_descriptor(f)
    assert (e.value.path, e.value.rule) == ("$.codegen", "known_codegen_family")
    assert "'mygen'" in str(e.value) and "triton" in str(e.value) and str(f) in str(e.value)

    registry.load_backends()
    monkeypatch.setattr(plugins, "_DECLARED", dict(plugins._DECLARED))
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_ORIGINS", dict(registry._ORIGINS))
    from portlayer.backends.cpu import CPUAdapter

    @registry.register_backend("mydev")
    class MyDev(CPUAdapter):
        device_type = "mydev"
        codegen_family = "mygen"

    d = load_descriptor(f)  # an adapter declaring 'mygen' is registered now
    assert type(registry.get_backend(d)) is MyDev


def test_descriptor_and_adapter_must_agree_on_codegen(tmp_path):
    raw = load_descriptor("cpu-x86_64").raw
    raw.update(name="cpu-triton", codegen="triton")
    f = tmp_path / "cpu-triton.json"
    f.write_text(json.dumps(raw))
    with pytest.raises(KeyError, match="asks for codegen 'triton'.*generates 'torch'"):
        registry.get_backend(load_descriptor(f))


def test_unserved_device_type_says_what_to_install(tmp_path):
    raw = load_descriptor("cpu-x86_64").raw
    raw.update(name="tpu-v9", device_type="tpu")
    f = tmp_path / "tpu.json"
    f.write_text(json.dumps(raw))
    d = load_descriptor(f)  # structure is valid: the schema does not list vendors
    with pytest.raises(KeyError, match="device_type 'tpu'.*install its adapter package"):
        registry.get_backend(d)
