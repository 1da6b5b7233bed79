"""The tensor-core tier of the few-rows GEMMs (tuning.gemv_dot_max_tokens), under TRITON_INTERPRET=1.

Rows in (gemv_max_tokens, gemv_dot_max_tokens] run the few-rows kernels with tl.dot as the product, all their
fusions kept: the plain kernel with its epilogue, Q|K|V-style siblings with the norm prologue and a bias, gate|up
with silu(gate) * up. Each form runs at 2, 5, 16, 33 and 64 rows (one launch of the tier's kernel, counted from
the kernels the program calls), at 1 row (the CUDA-core kernel) and at 65 (the vendor path), against torch ops
computed here in float64: in float32 (tl.dot in IEEE precision) and in float16 on bf16-valued inputs (the
interpreter multiplies bfloat16 as its uint16 storage, so 16-bit tensor-core products are checked in float16;
bfloat16 itself on the H200: scripts/gpu_gemv_dot.py). Weight-only int8 / int4 linears take the tier too (each W
tile dequantized into the activation's dtype). Tiny Qwen3 / Llama models compiled for a descriptor with the tier
match HF logits at decode batch 1, 4 and 20, and the tier's step launches the same kernels as the 1-row step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_quant_fused_decode import _build as quant_group
from triton_harness import build_program, h200_few_sms, record_launches, rel_err, use_interpreter

from portlayer.codegen.host_support import gemv_blocks
from portlayer.flatten.ir import GraphBuilder, TensorType

pytestmark = pytest.mark.interpreter
EPS = 1e-6
# a small W tile budget: the tier's K tile is 64 columns, so K = 80 / 96 / 200 take several tiles and a masked tail
LAUNCH = {"gemv": {"num_warps": 4, "TILE": 1024, "PROGRAMS": 4, "num_stages": 1}}
ROWS = (1, 2, 5, 16, 33, 64, 65)


@pytest.fixture(autouse=True)
def _interp(monkeypatch):
    use_interpreter(monkeypatch)


def tier_target(root: Path, dot: int, gemv: int = 1) -> Path:
    """nvidia-h200's descriptor with 4 SMs (fewer interpreted programs) and the tier up to ``dot`` rows."""
    return h200_few_sms(root, f"nvidia-h200-dot{dot}-gemv{gemv}", gemv_dot_max_tokens=dot, gemv_max_tokens=gemv)


def _form(kind: str, dtype: torch.dtype):
    """(graph, float64 reference of the feeds, input width) of one fused decode group."""
    g = torch.Generator().manual_seed(len(kind))
    dt = str(dtype).replace("torch.", "")
    k = {"plain": 200, "siblings": 80, "joint": 96}[kind]
    b = GraphBuilder()
    x = b.add_input("x", TensorType(dt, ("num_tokens", k)))
    if kind == "plain":  # one linear + bias + silu epilogue (gemv.py.j2)
        w, bias = (torch.randn(40, k, generator=g) * 0.1).to(dtype), torch.randn(40, generator=g).to(dtype)
        b.graph.outputs = [b.add1("silu", [b.add1("linear", [x, b.add_param("w", w), b.add_param("b", bias)])])]

        def want(f):
            return [F.silu(f["x"].double() @ w.double().T + bias.double())]

        return b.graph, want, k
    r = b.add_input("r", TensorType(dt, ("num_tokens", k)))
    nw = (0.5 + torch.rand(k, generator=g)).to(dtype)
    h = b.add1("add", [x, r])
    y = b.add1("rms_norm", [h, b.add_param("nw", nw)], {"eps": EPS})
    ns = [48, 24, 16] if kind == "siblings" else [72, 72]
    ws = [(torch.randn(n, k, generator=g) * 0.1).to(dtype) for n in ns]
    bias = torch.randn(24, generator=g).to(dtype)
    outs = [b.add1("linear", [y, b.add_param(f"w{i}", w)] + ([b.add_param("b1", bias)] if kind == "siblings" and i == 1
                                                               else [])) for i, w in enumerate(ws)]
    b.graph.outputs = (outs if kind == "siblings" else [b.add1("mul", [b.add1("silu", [outs[0]]), outs[1]])]) + [h]

    def want(f):
        hv = f["x"].double() + f["r"].double()
        yv = hv * torch.rsqrt(hv.pow(2).mean(-1, keepdim=True) + EPS) * nw.double()
        lin = [yv @ w.double().T for w in ws]
        if kind == "siblings":
            lin[1] = lin[1] + bias.double()
            return [*lin, hv]
        return [F.silu(lin[0]) * lin[1], hv]

    return b.graph, want, k


def _feeds(graph, t: int, k: int, dtype: torch.dtype, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random rows, rounded to bfloat16 values (exact in float16 at these magnitudes)."""
    return {v.name: torch.randn(t, k, generator=g).bfloat16().to(dtype) for v in graph.inputs}


def _check_rows(ours: list[torch.Tensor], want: list[torch.Tensor], tol: float, t: int) -> None:
    for o, w in zip(ours, want):
        assert o.shape == w.shape, (t, o.shape, w.shape)
        worst = max(rel_err(o[i], w[i]) for i in range(t))  # a row lost to a mask shows even among 64
        assert worst <= tol, (t, worst)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kind", ["plain", "siblings", "joint"])
def test_tensor_core_tier_of_each_few_rows_form(tmp_path, monkeypatch, kind, dtype):
    graph, want, k = _form(kind, dtype)
    launches: list[str] = []
    record_launches(monkeypatch, launches)
    gen, prog = build_program(graph, tmp_path, target=str(tier_target(tmp_path, 64)), launch=LAUNCH)
    tier = [s for s in gen.kernels.values() if s.name.startswith("gemv_dot_")]
    assert len(tier) == 1, list(gen.kernels)
    for t in range(2, 65):  # every pick the host can make for the tier's rows ships as a binary
        bm, bk = gemv_blocks(t, tier[0].constexprs["BLOCK_K"], 32, tensor_cores=True)
        assert {"BLOCK_M": bm, "BLOCK_K": bk} in tier[0].runtime_choices, (t, tier[0].runtime_choices)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    g = torch.Generator().manual_seed(7)
    for t in ROWS:
        feeds = _feeds(graph, t, k, dtype, g)
        launches.clear()
        ours = prog.run(feeds, None, None)
        if t == 1:
            assert len(launches) == 1 and launches[0].startswith("gemv_") and "dot" not in launches[0], launches
        elif t <= 64:
            assert launches == [tier[0].name], (t, launches)
        else:
            assert not any(n.startswith("gemv_") for n in launches), launches
        _check_rows(ours, want(feeds), tol, t)


CASES = [("single", 8, 96, 32, True), ("siblings", 4, 128, 32, True), ("joint", 4, 96, 96, False),
         ("joint", 8, 112, 16, True)]


@pytest.mark.parametrize("kind,bits,k,group,offsets", CASES)
def test_weight_only_quantized_groups_take_the_tier(tmp_path, monkeypatch, kind, bits, k, group, offsets):
    """int8 / int4 (packed nibbles), per group and per channel, with offsets: the tile dequantized, then tl.dot;
    against the integers unpacked and dequantized in float64 (test_quant_fused_decode's reference)."""
    graph, want = quant_group(kind, bits, k, group, offsets)
    launches: list[str] = []
    record_launches(monkeypatch, launches)
    _, prog = build_program(graph, tmp_path, target=str(tier_target(tmp_path, 64)), launch=LAUNCH)
    g = torch.Generator().manual_seed(k)
    for t in (2, 16, 33):
        xv = torch.randn(t, k, generator=g)
        rv = torch.randn(t, k, generator=g) if kind != "single" else None
        launches.clear()
        ours = prog.run({"x": xv, **({"r": rv} if rv is not None else {})}, None, None)
        assert len(launches) == 1 and launches[0].startswith("gemv_dot_") and f"w{bits}" in launches[0], launches
        _check_rows(ours, want(xv, rv), 1e-5, t)


def test_a_descriptor_with_only_the_tier_fuses_and_runs_it_from_one_row(tmp_path, monkeypatch):
    """gemv_max_tokens 0, gemv_dot_max_tokens 8: the fuse pass still forms norm + siblings (either tier is
    enough), and every row count up to 8 runs the tier's one launch."""
    graph, want, k = _form("siblings", torch.float32)
    launches: list[str] = []
    record_launches(monkeypatch, launches)
    _, prog = build_program(graph, tmp_path, target=str(tier_target(tmp_path, 8, gemv=0)), launch=LAUNCH)
    groups = [kg for kg in prog.result.graph.meta["kernels"] if kg["family"] != "view"]
    assert len(groups) == 1 and groups[0]["prologue"], [kg["nodes"] for kg in groups]
    g = torch.Generator().manual_seed(3)
    for t in (1, 8, 9):
        feeds = _feeds(graph, t, k, torch.float32, g)
        launches.clear()
        ours = prog.run(feeds, None, None)
        assert (len(launches) == 1 and launches[0].startswith("gemv_dot_")) == (t <= 8), (t, launches)
        _check_rows(ours, want(feeds), 1e-5, t)
