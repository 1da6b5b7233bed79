"""AOT tier: the kernels the MoE and MLA lowerings generate (one-op bfloat16 graphs through the
pass pipeline and the lowering registry) compile with triton.compile for sm_90 (H200) and gfx942
(MI300X) without a GPU: the paged attention kernels in the MLA lowering's MQA form (one KV head,
rank + rope wide), and the fused MoE stages at BLOCK_M 16, the tile the host program picks at
decode (the descriptor's largest tile is compiled by test_triton_aot_moe)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_mla_lowering import _graph as mla_graph
from test_moe_lowering import _moe_graph

pytestmark = pytest.mark.aot


@pytest.mark.parametrize("descriptor, target", [("nvidia-h200", "sm90"), ("amd-mi300x", "gfx942")])
def test_moe_and_mla_kernels_compile(tmp_path, descriptor, target):
    from portlayer.backends.generate import generate
    from portlayer.codegen.program import write_program
    from portlayer.passes.pipeline import run_pipeline

    out, kept = tmp_path / "aot", {}
    (out / "kernels").mkdir(parents=True)
    for i, graph in enumerate([_moe_graph(16, 4, 256, 128, torch.bfloat16, seed=0), mla_graph(torch.bfloat16)]):
        res = run_pipeline(graph, descriptor, overrides={"compute_dtype": "bfloat16", "weight_quantization": "none"})
        gen = generate(res.graph, res.plan, res.descriptor)
        assert gen.fallbacks == [], gen.fallbacks
        write_program(gen, tmp_path / f"g{i}")
        info = json.loads((tmp_path / f"g{i}" / "kernels.json").read_text())
        # the descriptor's MoE tile is compiled by test_triton_aot_moe; the router's row softmax is not ours
        for name, k in info["kernels"].items():
            if name.startswith("fused_moe"):
                kept[f"{name}_bm16"] = {**k, "constexprs": {**k["constexprs"], "BLOCK_M": 16}}
            elif name.startswith(("attn_", "reshape_and_cache")):
                kept[name] = k
            else:
                continue
            src = tmp_path / f"g{i}" / "kernels" / f"{k['module']}.py"
            (out / "kernels" / src.name).write_text(src.read_text())
    (out / "kernels.json").write_text(json.dumps({"kernels": kept}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, "-m", "portlayer.codegen.aot", str(out), "--target", target],
                          capture_output=True, text=True, env=env, timeout=600)
    report = json.loads(proc.stdout or "[]")
    assert report and all(r["ok"] for r in report), (proc.stderr[-2000:], [r for r in report if not r["ok"]])
    names = {r["kernel"] for r in report}
    assert any(n.startswith("fused_moe_gate_up") and n.endswith("_bm16") for n in names)
    assert any(n.startswith("attn_decode") for n in names) and any(n.startswith("reshape_and_cache") for n in names)
