"""Architectures no issue names, end to end: compile for the CPU (capture -> passes -> generated
program -> artifact), validate, and generate through the paged-KV engine == HF generate."""

from __future__ import annotations

import pytest
import torch
from test_capture_archs import ARCHS, COMMON

import portlayer
from portlayer.runtime.engine import LLMEngine
from portlayer.runtime.sequence import SamplingParams

DECODERS = sorted(n for n in ARCHS if not n.startswith("roberta"))


@pytest.mark.parametrize("name", DECODERS)
def test_compiled_generation_matches_hf(name, tmp_path):
    cfg_cls, model_cls, kw = ARCHS[name]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**COMMON, **kw})).eval()
    art = tmp_path / "art"
    portlayer.compile(model, target="cpu-x86_64", output=art, progress=False)
    assert portlayer.load(art).validate().ok
    engine = LLMEngine.from_artifact(art)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 17, 33)]  # > sliding window 4
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    model.set_attn_implementation("eager")
    for prompt, out in zip(prompts, outs):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref, (name, len(prompt))
