"""The generated CANN op-call program (codegen/cann.py) run end to end through the runtime
engine on the CPU **emulator** of torch_npu (backends/ascend_emulator.py): greedy tokens equal
HF's for 8 prompts of 1..200 tokens. No Ascend NPU was involved.

Snapshots of the generated program live in tests/golden/cann/; after an intended change:

    PORTLAYER_UPDATE_GOLDEN=1 pytest tests/test_ascend_program.py
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import portlayer
from portlayer.runtime.artifact import ArtifactError
from portlayer.runtime.engine import LLMEngine
from portlayer.runtime.sequence import SamplingParams

GOLDEN = Path(__file__).parent / "golden" / "cann"
UPDATE = os.environ.get("PORTLAYER_UPDATE_GOLDEN") == "1"
LENGTHS = [1, 7, 33, 64, 100, 129, 180, 200]
NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in LENGTHS]


def hf_tokens(model_dir: Path) -> dict[tuple[int, ...], list[int]]:
    from conftest import hf_model

    hf = hf_model(model_dir)
    out = {}
    for p in prompts():
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        out[tuple(p)] = gen[0, len(p):].tolist()
    return out


@pytest.fixture(scope="module")
def qwen3_hd64(tmp_path_factory, tiny_dirs) -> Path:
    """Tiny Qwen3 with head_dim 64: the TND FIA head-dim rule (64/128/192) admits it, so prefill
    goes through npu_fused_infer_attention_score (tiny-qwen3's head_dim 16 does not)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=256, max_position_embeddings=512,
                      tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("qwen3-hd64")
    Qwen3ForCausalLM(cfg).save_pretrained(str(d))
    for f in tiny_dirs["tiny-qwen3"].glob("tokenizer*"):
        shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    cache: dict[tuple[str, str], Path] = {}

    def get(model_dir: Path, dtype: str) -> Path:
        key = (str(model_dir), dtype)
        if key not in cache:
            out = tmp_path_factory.mktemp("ascend-art") / f"{model_dir.name}-{dtype}"
            portlayer.compile(str(model_dir), target="ascend-910b", dtype=dtype, output=out, progress=False)
            cache[key] = out
        return cache[key]

    return get


def run(art: Path) -> tuple[list, dict[str, int]]:
    eng = LLMEngine.from_artifact(art, emulate=True)
    outs = eng.generate(prompts(), GREEDY)
    return outs, dict(eng.executable.npu.calls)


@pytest.mark.parametrize("name,dtype", [("tiny-qwen3", "float32"), ("tiny-llama", "float32"),
                                        ("tiny-qwen3", "float16"), ("tiny-llama", "float16")])
def test_generate_matches_hf_under_emulator(tiny_dirs, artifacts, name, dtype):
    art = artifacts(tiny_dirs[name], dtype)
    outs, calls = run(art)
    ref = hf_tokens(tiny_dirs[name])
    for p, o in zip(prompts(), outs):
        assert o.token_ids == ref[tuple(p)], f"{name} {dtype}: prompt of {len(p)} tokens"
    assert calls["npu_add_rms_norm"] and calls["npu_swiglu"]  # gate|up concatenated at load
    if dtype == "float16":  # head_dim 16: rope in place (mrope refused), decode via ATB paged attention
        assert calls["_npu_rotary_embedding"] and calls["_npu_reshape_and_cache"] and calls["_npu_paged_attention"]
        assert "npu_fused_infer_attention_score" not in calls  # FIA refused for head_dim 16 (TND 64/128/192)
    else:  # fp32: the fp16/bf16-only attention calls are refused by select; attention is the reference op
        assert calls["npu_mrope"] and "_npu_paged_attention" not in calls


def test_fia_prefill_and_paged_decode_match_hf(qwen3_hd64, artifacts):
    art = artifacts(qwen3_hd64, "float16")
    host = (art / "host.py").read_text()
    assert 'input_layout="TND", sparse_mode=3' in host and 'cache_mode="Norm"' in host
    outs, calls = run(art)
    ref = hf_tokens(qwen3_hd64)
    for p, o in zip(prompts(), outs):
        assert o.token_ids == ref[tuple(p)], f"prompt of {len(p)} tokens"
    # one all-prefill step (8 prompts fit the token budget) x 2 layers; 15 decode-only steps x 2 layers
    assert calls["npu_fused_infer_attention_score"] == 2
    assert calls["_npu_paged_attention"] == 30
    assert calls["npu_scatter_pa_kv_cache"] == 32 and calls["npu_mrope"] == 32


def test_mixed_and_chunked_steps_go_through_fia(qwen3_hd64, artifacts):
    """Staggered arrival (prefill + decode in one step) and 48-token chunks (prefill over cached context)."""
    art = artifacts(qwen3_hd64, "float16")
    eng = LLMEngine.from_artifact(art, emulate=True, prefill_chunk_size=48, max_batched_tokens=64)
    ps = prompts()
    ref = hf_tokens(qwen3_hd64)
    order = [eng.requests[eng.add_request(ps[0], GREEDY)]]
    eng.step()
    for p in ps[1:4]:
        order.append(eng.requests[eng.add_request(p, GREEDY)])
        eng.step()
    while eng.has_unfinished():
        eng.step()
    for p, seq in zip(ps, order):
        assert seq.output_token_ids == ref[tuple(p)], f"prompt of {len(p)} tokens"
    assert eng.executable.npu.calls["npu_fused_infer_attention_score"] > 2


def test_validation_set_without_cache_uses_fia_prefill_no_cache(qwen3_hd64, artifacts):
    from portlayer.loaded import open_artifact

    loaded = open_artifact(artifacts(qwen3_hd64, "float16"), emulate=True)
    exe = loaded.executable()
    report = loaded.validate(exe)
    assert report.ok, report.format_table()
    assert exe.npu.calls["npu_fused_infer_attention_score"] > 0


def test_load_needs_explicit_emulation(tiny_dirs, artifacts, monkeypatch):
    art = artifacts(tiny_dirs["tiny-qwen3"], "float16")
    monkeypatch.delenv("PORTLAYER_ASCEND_EMULATOR", raising=False)
    with pytest.raises(ArtifactError, match="no device here matches"):
        portlayer.load(art)  # the device check is not weakened: there is no NPU here
    from portlayer.loaded import open_artifact

    loaded = open_artifact(art, emulate=True)
    assert loaded.emulated and loaded.device.status == "emulated" and loaded.device.torch_device == "cpu"
    assert loaded.manifest.raw["codegen"]["generated"]


def test_validate_cli_with_emulator(tiny_dirs, artifacts, monkeypatch, capsys):
    from portlayer.cli import main

    art = artifacts(tiny_dirs["tiny-qwen3"], "float16")
    monkeypatch.delenv("PORTLAYER_ASCEND_EMULATOR", raising=False)
    assert main(["validate", str(art), "--emulate-ascend"]) == 0
    assert "emulator" in capsys.readouterr().err
    monkeypatch.setenv("PORTLAYER_ASCEND_EMULATOR", "1")
    assert main(["validate", str(art)]) == 0


def test_emulate_refuses_non_cann_artifact(tiny_dirs, tmp_path):
    from portlayer.loaded import open_artifact

    art = portlayer.compile(str(tiny_dirs["tiny-qwen3"]), target="cpu-x86_64", output=tmp_path / "cpu", progress=False)
    with pytest.raises(ArtifactError, match="only CANN"):
        open_artifact(art.path, emulate=True)


def test_adapter_probe_reports_unavailable():
    from portlayer.backends.registry import available_backends, get_backend

    assert "ascend" in available_backends()
    adapter = get_backend("ascend-910b")
    assert type(adapter).__name__ == "AscendAdapter" and adapter.codegen_family == "cann"
    probe = adapter.probe()
    assert probe and not any(d.usable for d in probe) and "torch_npu" in probe[0].reason


@pytest.fixture(scope="module")
def golden_sources(captured):
    from portlayer.backends.generate import generate
    from portlayer.passes.pipeline import run_pipeline

    files = {}
    for dtype in ("float16", "float32"):
        res = run_pipeline(captured["tiny-qwen3"], "ascend-910b", overrides={"compute_dtype": dtype})
        files[f"host_tiny_qwen3_910b_{dtype}.py"] = generate(res.graph, res.plan, res.descriptor).host
    return files


def test_generated_cann_program_matches_golden(golden_sources):
    if UPDATE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for name, src in golden_sources.items():
            (GOLDEN / name).write_text(src)
    missing = sorted(n for n in golden_sources if not (GOLDEN / n).exists())
    assert not missing, f"no snapshot for {missing}; run with PORTLAYER_UPDATE_GOLDEN=1"
    changed = [n for n, src in golden_sources.items() if (GOLDEN / n).read_text() != src]
    assert not changed, f"generated CANN program changed: {changed}; review, then PORTLAYER_UPDATE_GOLDEN=1"
