"""Every torch_npu call the CANN generator emits, checked against the real torch-npu 2.14.0 wheel.

The wheel (43 MB, PyPI) is fetched once with ``pip download --no-deps`` into
``$PORTLAYER_WHEEL_CACHE`` (default ~/.cache/portlayer/wheels: outside the per-session test cache,
so one CI run downloads it once) and opened as a zip, never installed. Its YAML schemas (torchgen's
parser) and its ATB header give the reference for op names, argument names and order, keyword-only
markers, defaults and tensor/scalar kinds; its meta functions (run in a child process with the
torch_npu imports stubbed) give the reference output shapes/dtypes the emulator must reproduce.
If the wheel cannot be fetched, every test here SKIPS with pip's reason (shown by ``-rs``): a skip,
not a pass.
"""

from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path

import pytest
import torch

import portlayer
from portlayer.backends import ascend_emulator
from portlayer.backends.ascend_conformance import (
    RecordingNpu,
    call_problems,
    calls_in_source,
    meta_ops,
    signature_problems,
    to_json,
    wheel_meta,
)
from portlayer.backends.ascend_schemas import WHEEL_VERSION, WheelUnavailable, load_schemas, obtain_wheel

EMITTABLE = {"npu_rms_norm", "npu_add_rms_norm", "npu_mrope", "_npu_rotary_embedding", "npu_swiglu",
             "npu_scatter_pa_kv_cache", "_npu_reshape_and_cache", "_npu_paged_attention",
             "npu_fused_infer_attention_score", "npu_rotary_mul", "npu_weight_quant_batchmatmul"}
SOURCES = [("tiny-qwen3", "float16"), ("tiny-qwen3", "bfloat16"), ("tiny-qwen3", "float32"),
           ("tiny-llama", "float16"), ("tiny-llama", "float32"), ("qwen3-hd64", "float16"),
           ("qwen3-hd64", "bfloat16"), ("bert-hd64", "float16"), ("qwen3-emb-hd64", "float16")]


@pytest.fixture(scope="module")
def schemas():
    base = Path(os.environ.get("PORTLAYER_WHEEL_CACHE") or Path.home() / ".cache" / "portlayer" / "wheels")
    try:
        wheel = obtain_wheel(base / f"torch-npu-{WHEEL_VERSION}")
    except WheelUnavailable as e:
        pytest.skip(f"NOT VERIFIED: torch-npu {WHEEL_VERSION} wheel unavailable: {e}")
    return load_schemas(wheel, EMITTABLE | {n for n in dir(ascend_emulator.AscendEmulator) if "npu" in n})


@pytest.fixture(scope="module")
def models(tiny_dirs, tmp_path_factory) -> dict[str, Path]:
    """The tiny test models, plus Qwen3 with head_dim 64 (the head dim TND FIA admits)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=256, max_position_embeddings=512,
                      tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("qwen3-hd64")
    Qwen3ForCausalLM(cfg).save_pretrained(str(d))
    for f in tiny_dirs["tiny-qwen3"].glob("tokenizer*"):
        shutil.copy(f, d / f.name)
    from test_ascend_encoders import _bert_hd64, _qwen3_embedding_hd64

    enc = {name: tmp_path_factory.mktemp(name) for name in ("bert-hd64", "qwen3-emb-hd64")}
    _bert_hd64(enc["bert-hd64"])
    _qwen3_embedding_hd64(enc["qwen3-emb-hd64"])
    return {**tiny_dirs, "qwen3-hd64": d, **enc}


@pytest.fixture(scope="module")
def artifacts(models, tmp_path_factory):
    cache: dict[tuple[str, str], Path] = {}

    def get(name: str, dtype: str) -> Path:
        if (name, dtype) not in cache:
            out = tmp_path_factory.mktemp("conf") / f"{name}-{dtype}"
            portlayer.compile(str(models[name]), target="ascend-910b", dtype=dtype, output=out, progress=False)
            cache[name, dtype] = out
        return cache[name, dtype]

    return get


def test_wheel_is_the_pinned_version(schemas, record_property):
    record_property("torch_npu_wheel", f"{schemas.wheel.name} sha256={schemas.sha256}")
    print(f"\nschemas: {schemas.wheel} (torch_npu {schemas.version}, git {schemas.git_version}, sha256 {schemas.sha256})")
    assert schemas.version == WHEEL_VERSION
    assert not [n for n in EMITTABLE if not schemas.overloads(n)], "an emittable call is missing from the wheel"


def test_emulator_signatures_match_the_wheel(schemas):
    names = sorted(n for n, f in inspect.getmembers(ascend_emulator.AscendEmulator, inspect.isfunction)
                   if n.startswith(("npu_", "_npu_")))
    assert set(names) >= EMITTABLE - {"npu_weight_quant_batchmatmul"}
    problems = [p for n in names for p in signature_problems(schemas, n, getattr(ascend_emulator.AscendEmulator, n))]
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def host_source(models):
    from portlayer.backends.generate import generate
    from portlayer.flatten import capture
    from portlayer.passes.pipeline import run_pipeline

    graphs: dict[str, object] = {}

    def get(name: str, dtype: str) -> str:
        if name not in graphs:
            graphs[name] = capture(models[name])
        res = run_pipeline(graphs[name], "ascend-910b", overrides={"compute_dtype": dtype})
        return generate(res.graph, res.plan, res.descriptor).host

    return get


@pytest.mark.parametrize("name,dtype", SOURCES)
def test_every_emitted_call_binds_to_the_wheel_schema(schemas, host_source, name, dtype):
    """All npu.* calls in the generated program (every branch), literal values included."""
    host = host_source(name, dtype)
    calls = calls_in_source(host, where=f"{name}-{dtype}/host.py")
    assert calls, "no torch_npu call in the generated program"
    problems = [p for c in calls for p in call_problems(schemas, c)]
    assert not problems, "\n".join(problems)
    assert {c.name for c in calls} <= EMITTABLE, "a call this test does not know: add it to EMITTABLE"


def _run_recorded(art: Path, monkeypatch) -> RecordingNpu:
    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.sequence import SamplingParams

    rec: list[RecordingNpu] = []
    real = ascend_emulator.AscendEmulator

    def make() -> RecordingNpu:
        rec.append(RecordingNpu(real()))
        return rec[-1]

    monkeypatch.setattr(ascend_emulator, "AscendEmulator", make)
    eng = LLMEngine.from_artifact(art, emulate=True, prefill_chunk_size=16, max_batched_tokens=24)
    g = torch.Generator().manual_seed(0)
    eng.generate([torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 20)],
                 SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    return rec[-1]


RUN_TIME = [("qwen3-hd64", "float16"), ("tiny-qwen3", "float16")]


def test_run_time_calls_bind_and_match_the_wheel_meta_shapes(schemas, artifacts, monkeypatch):
    """Real argument values (tensor vs scalar kinds) bind; the emulator's output shapes/dtypes equal
    those of the wheel's own meta functions for the same inputs (prefill, chunked prefill, decode)."""
    calls = [c for name, dtype in RUN_TIME for c in _run_recorded(artifacts(name, dtype), monkeypatch).recorded]
    assert {c.name for c in calls} >= {"npu_fused_infer_attention_score", "_npu_paged_attention", "npu_mrope",
                                       "npu_scatter_pa_kv_cache", "_npu_rotary_embedding", "_npu_reshape_and_cache",
                                       "npu_add_rms_norm", "npu_swiglu"}
    problems = [p for c in calls for p in call_problems(schemas, c)]
    assert not problems, "\n".join(problems)
    have_meta = meta_ops(schemas)
    unique = {}
    for c in calls:
        if c.name in have_meta:
            unique.setdefault(repr((c.name, to_json(c.args), to_json(c.kwargs))), c)
    checked = list(unique.values())
    assert checked, "no emitted call has a meta function in the wheel"
    results = wheel_meta(schemas.wheel, checked)
    diffs = []
    for c, r in zip(checked, results):
        ours = to_json(c.result)
        if not r["ok"]:
            diffs.append(f"{c.name}{to_json(c.args)} {to_json(c.kwargs)}: the wheel's meta function raised {r['error']}")
        elif _norm(r["result"]) != _norm(ours):
            diffs.append(f"{c.name}: emulator {ours}, wheel meta {r['result']}")
    assert not diffs, "\n".join(diffs)


def _norm(v):
    """None and () both mean "no output" (in-place ops)."""
    return None if v in (None, []) else v
