"""AOT tier: the fused MoE kernels, with the tiles each device's descriptor picks, compile
with triton.compile for sm_90 (H200) and gfx942 (MI300X) on a machine without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from portlayer.capabilities.descriptor import load_descriptor
from portlayer.codegen.kernels.moe import build_fused_moe, moe_config

pytestmark = pytest.mark.aot


@pytest.mark.parametrize("descriptor, target", [("nvidia-h200", "sm90"), ("amd-mi300x", "gfx942")])
def test_fused_moe_compiles(tmp_path, descriptor, target):
    desc = load_descriptor(descriptor)
    smem = desc.compute_units.max_shared_memory_per_block_bytes or desc.compute_units.shared_memory_per_unit_bytes
    cfg = moe_config(smem, desc.warp_size, "bfloat16", hidden=256, inter=128)
    specs = build_fused_moe("bfloat16", "silu", cfg, top_k=8, hidden=256, inter=128)
    (tmp_path / "kernels").mkdir()
    meta = {}
    for s in specs:
        (tmp_path / "kernels" / f"{s.name}.py").write_text(s.source)
        meta[s.name] = {"fn": s.fn, "signature": s.signature(), "constexprs": s.constexprs, "num_warps": s.num_warps,
                        "num_stages": s.num_stages, "module": s.name}
    (tmp_path / "kernels.json").write_text(json.dumps({"kernels": meta}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, "-m", "portlayer.codegen.aot", str(tmp_path), "--target", target],
                          capture_output=True, text=True, env=env, timeout=600)
    report = json.loads(proc.stdout or "[]")
    assert report and all(r["ok"] for r in report), (proc.stderr[-2000:], report)
    assert {r["kernel"] for r in report} == {s.name for s in specs} and all(r["bytes"] > 0 for r in report)
