"""AOT tier: every kernel of the generated tiny-Qwen3 program (bf16, the GPUs' compute
dtype) compiles with triton.compile for sm_80, sm_90, gfx942 and gfx1100 without a GPU,
each target with the launch configs its own descriptor's Plan chose. Intel XPU renders
only: PyPI Triton has no XPU backend (see docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.aot

TARGETS = [("nvidia-a100-80gb", "sm80"), ("nvidia-h200", "sm90"), ("amd-mi300x", "gfx942"),
           ("amd-rx7900xtx", "gfx1100")]  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_bf16(tiny_dirs):
    from portlayer.flatten import capture

    return capture(tiny_dirs["tiny-qwen3"], dtype=torch.bfloat16)


def _write(graph, descriptor: str, out):
    from portlayer.backends.generate import generate
    from portlayer.codegen.program import write_program
    from portlayer.passes.pipeline import run_pipeline

    r = run_pipeline(graph, descriptor, overrides={"weight_quantization": "none"})
    gen = generate(r.graph, r.plan, r.descriptor)
    assert gen.fallbacks == [] and gen.kernels
    write_program(gen, out)
    return gen


@pytest.mark.parametrize("descriptor,target", TARGETS)
def test_every_kernel_compiles(qwen3_bf16, tmp_path, descriptor, target):
    gen = _write(qwen3_bf16, descriptor, tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, "-m", "portlayer.codegen.aot", str(tmp_path), "--target", target],
                          capture_output=True, text=True, env=env, timeout=600)
    report = json.loads(proc.stdout or "[]")
    failed = [r for r in report if not r["ok"]]
    assert not failed, failed
    # one compiled binary per launch configuration of every kernel (NAME, then NAME.v1, NAME.v2, ...)
    want = {name if i == 0 else f"{name}.v{i}" for name, k in gen.kernels.items() for i in range(len(k.launches()))}
    assert {r["kernel"] for r in report} == want
    assert all(r["bytes"] > 0 for r in report)


def test_xpu_renders_with_its_descriptor(qwen3_bf16, tmp_path):
    gen = _write(qwen3_bf16, "intel-arc-a770", tmp_path)
    nv = _write(qwen3_bf16, "nvidia-h200", tmp_path / "nv")
    assert "# l0_self_attn_attention: triton.paged_attention" in gen.host
    # same templates, different launch configs: the A770's 16-wide subgroups get more warps
    warps = {k.family: k.num_warps for k in gen.kernels.values()}
    warps_nv = {k.family: k.num_warps for k in nv.kernels.values()}
    assert warps["attn_prefill"] > warps_nv["attn_prefill"]
