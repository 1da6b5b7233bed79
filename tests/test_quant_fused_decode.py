"""Weight-only int8 / int4 linears in the fused few-rows kernels (issue 12 lever 6), under TRITON_INTERPRET=1.

Each case is a decode-time group the fuse pass forms (norm prologue + one linear_wq, norm + Q|K|V-style
siblings, residual add + norm + gate|up with silu(gate) * up), run at 1 and 3 rows (one few-rows launch,
counted from the kernels the program really calls), at 5 rows (above the rows rule: the norm kernel, then
the tiled weight-only GEMMs) and at 7 rows (from tuning.wq_vendor_min_tokens, here 6: each weight
dequantized by one launch, then torch.mm). The reference is computed here: the integers unpacked with torch bit
ops, dequantized per group (q * scale [+ offset]), then rms_norm / F.linear / silu in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_harness import build_program, record_launches, rel_err, use_interpreter

from portlayer.codegen.lowering import Unlowerable
from portlayer.flatten.ir import GraphBuilder, TensorType

pytestmark = pytest.mark.interpreter
EPS = 1e-6
LAUNCH = {"gemm": {"num_warps": 4, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_stages": 1},
          "gemv": {"num_warps": 4, "TILE": 512, "PROGRAMS": 2, "num_stages": 1},
          # K tiles of 64, two unrolled a loop step: the small K here still takes several steps and partial tiles
          "gemv_wq": {"num_warps": 4, "BLOCK_N": 4, "BLOCK_K": 64, "UNROLL": 2, "num_stages": 1}}


@pytest.fixture(autouse=True)
def _interp(monkeypatch):
    use_interpreter(monkeypatch)


def _quantized(g: torch.Generator, n: int, k: int, bits: int, group: int, offsets: bool):
    """(stored integers as linear_wq takes them, scales, offsets or None, the float64 weight, written out here)."""
    lo, hi = (-8, 8) if bits == 4 else (-128, 128)
    q = torch.randint(lo, hi, (n, k), generator=g)
    s = torch.rand(n, k // group, generator=g) * 0.02 + 0.002
    o = torch.randn(n, k // group, generator=g) * 0.01 if offsets else None
    if bits == 4:
        u = (q + 8).to(torch.uint8)
        stored = u[:, 0::2] | (u[:, 1::2] << 4)
        # unpack the stored bytes again (as a reader of the format would) so the reference uses the bytes
        p = stored.to(torch.int16)
        q = torch.stack(((p & 0xF) - 8, (p >> 4) - 8), dim=-1).reshape(n, k)
    else:
        stored = q.to(torch.int8)
    w = q.double().reshape(n, k // group, group) * s.double()[:, :, None]
    if o is not None:
        w = w + o.double()[:, :, None]
    return stored, s, o, w.reshape(n, k)


def _build(kind: str, bits: int, k: int, group: int, offsets: bool, mixed: bool = False, norm: bool = True):
    """The graph and a float64 reference function of (x, r) for one fused decode group (``norm``: with the residual
    add + RMSNorm before the linears; without it the linears read x, and r is unused)."""
    g = torch.Generator().manual_seed(bits * 1000 + k * 7 + group + len(kind))
    b = GraphBuilder()
    x = b.add_input("x", TensorType("float32", ("num_tokens", k)))
    r = b.add_input("r", TensorType("float32", ("num_tokens", k))) if kind != "single" and norm else None
    nw = (0.5 + torch.rand(k, generator=g))
    h = b.add1("add", [x, r]) if r else x
    y = b.add1("rms_norm", [h, b.add_param("nw", nw)], {"eps": EPS}) if norm else x
    ns = {"single": [40], "siblings": [24, 8, 8], "joint": [36, 36]}[kind]
    ws, biases, outs = [], [], []
    for i, n in enumerate(ns):
        bias = torch.randn(n, generator=g) if kind == "siblings" and i == 1 else None
        if mixed and i == 0:
            w = torch.randn(n, k, generator=g) * 0.05
            outs.append(b.add1("linear", [y, b.add_param(f"w{i}", w.float())]))
            ws.append(w.double())
        else:
            stored, s, o, w = _quantized(g, n, k, bits, group, offsets)
            ins = [y, b.add_param(f"q{i}", stored), b.add_param(f"s{i}", s),
                   b.add_param(f"b{i}", bias) if bias is not None else None]
            if o is not None:
                ins.append(b.add_param(f"o{i}", o))
            outs.append(b.add1("linear_wq", ins, {"bits": bits, "group_size": group}))
            ws.append(w)
        biases.append(bias)
    if kind == "joint":
        b.graph.outputs = [b.add1("mul", [b.add1("silu", [outs[0]]), outs[1]])] + ([h] if norm else [])
    else:
        b.graph.outputs = outs

    def want(xv: torch.Tensor, rv: torch.Tensor | None) -> list[torch.Tensor]:
        hv = xv.double() + (rv.double() if rv is not None and norm else 0)
        yv = hv * torch.rsqrt(hv.pow(2).mean(-1, keepdim=True) + EPS) * nw.double() if norm else hv
        lin = [F.linear(yv, w, None if bb is None else bb.double()) for w, bb in zip(ws, biases)]
        return ([F.silu(lin[0]) * lin[1]] + ([hv] if norm else [])) if kind == "joint" else lin

    return b.graph, want


CASES = [  # kind, bits, K, group, offsets: grouped and per channel (K = group), tiles inside a group and spanning groups
    ("single", 8, 96, 32, True), ("single", 4, 192, 192, False), ("single", 8, 80, 80, True),
    ("siblings", 8, 64, 16, False), ("siblings", 4, 128, 32, True), ("siblings", 4, 96, 96, True),
    ("joint", 4, 96, 32, False), ("joint", 8, 112, 112, True), ("joint", 4, 128, 64, True),
]


@pytest.mark.parametrize("kind,bits,k,group,offsets", CASES)
def test_quantized_fused_decode_group(tmp_path, monkeypatch, kind, bits, k, group, offsets):
    from portlayer.codegen import gemm_rule

    graph, want = _build(kind, bits, k, group, offsets)
    launches: list[str] = []
    record_launches(monkeypatch, launches)
    monkeypatch.setattr(gemm_rule, "wq_vendor_min_tokens", lambda descriptor: 6)
    _, prog = build_program(graph, tmp_path, launch=LAUNCH, gemv_max_tokens=4, gemv_dot_max_tokens=0)
    groups = [kg for kg in prog.result.graph.meta["kernels"] if kg["family"] not in ("view",)]
    assert len(groups) == 1 and groups[0]["prologue"], [kg["nodes"] for kg in groups]  # norm + linears (+ epilogue)
    g = torch.Generator().manual_seed(k)
    tail = ["pointwise"] if kind == "joint" else []  # silu(gate) * up after the GEMMs
    for t in (1, 3, 5, 7):
        xv = torch.randn(t, k, generator=g)
        rv = torch.randn(t, k, generator=g) if kind != "single" else None
        launches.clear()
        ours = prog.run({"x": xv, **({"r": rv} if rv is not None else {})}, None, None)
        kinds = [n.split("_")[0] + ("_w" if n.startswith("gemm_w") else "") for n in launches]
        n_lin = len(graph.find("linear_wq"))
        if t <= 4:  # at decode rows: one launch of the fused few-rows kernel, the norm inside it
            assert len(launches) == 1 and launches[0].startswith("gemv_") and "rms" in launches[0], launches
        elif t == 5:  # above the rule: the norm kernel, then a weight-only GEMM per linear (the epilogue in the last)
            assert kinds == ["reduction"] + ["gemm_w"] * n_lin, launches
        else:  # the norm kernel, each weight dequantized (torch.mm is no Triton launch), the epilogue
            assert kinds == ["reduction"] + ["dequant"] * n_lin + tail, launches
        for o, w in zip(ours, want(xv, rv)):
            assert o.shape == w.shape and rel_err(o, w) <= 1e-4, (t, rel_err(o, w))


def test_tiles_inside_a_group_and_spanning_groups_both_run(tmp_path):
    """The cases above reach both dequant forms of _dequant.j2 (else a form would go untested)."""
    forms = set()
    for kind, bits, k, group, offsets in CASES:
        graph, _ = _build(kind, bits, k, group, offsets)
        gen, _ = build_program(graph, tmp_path / f"{kind}{bits}{k}{group}", launch=LAUNCH, gemv_max_tokens=4, gemv_dot_max_tokens=0)
        for spec in gen.kernels.values():
            if spec.name.startswith("gemv_"):
                forms |= {f for f, mark in (("in", "one scale per column"), ("span", "one scale per (column, group)"))
                          if mark in spec.source}
    assert forms == {"in", "span"}, forms


def test_a_float_and_a_quantized_sibling_are_refused_with_a_reason(tmp_path):
    graph, want = _build("siblings", 8, 64, 32, True, mixed=True)
    _, prog = build_program(graph, tmp_path, launch=LAUNCH, gemv_max_tokens=4, gemv_dot_max_tokens=0)
    refused = prog.result.graph.meta["fusion"]["refused"]
    assert any("one launch reads one weight layout" in why for why in refused.values()), refused
    g = torch.Generator().manual_seed(1)
    for t in (1, 5):
        xv, rv = torch.randn(t, 64, generator=g), torch.randn(t, 64, generator=g)
        for o, w in zip(prog.run({"x": xv, "r": rv}, None, None), want(xv, rv)):
            assert rel_err(o, w) <= 1e-4, (t, rel_err(o, w))


NO_NORM = [  # kind, bits, K, group, offsets: the sub-group form (no norm prologue), sub-groups below and at the group
    ("single", 4, 192, 192, False), ("single", 8, 96, 32, True), ("single", 4, 320, 64, True),
    ("siblings", 4, 128, 32, True), ("siblings", 8, 80, 80, False), ("joint", 4, 96, 32, False),
    ("joint", 8, 112, 112, True),
]


@pytest.mark.parametrize("kind,bits,k,group,offsets", NO_NORM)
def test_quantized_decode_group_without_a_norm(tmp_path, monkeypatch, kind, bits, k, group, offsets):
    """Linears that read their input directly take the sub-group form (launch.gemv_wq's tiles); at 1 and 3 rows
    their few-rows launches match the float64 reference, as do the larger row counts' paths."""
    from portlayer.codegen import gemm_rule

    graph, want = _build(kind, bits, k, group, offsets, norm=False)
    launches: list[str] = []
    record_launches(monkeypatch, launches)
    monkeypatch.setattr(gemm_rule, "wq_vendor_min_tokens", lambda descriptor: 6)
    gen, prog = build_program(graph, tmp_path, launch=LAUNCH, gemv_max_tokens=4, gemv_dot_max_tokens=0)
    few = [s for s in gen.kernels.values() if s.name.startswith("gemv_")]
    assert few and all("SUB" in s.constexprs and "rms" not in s.name for s in few), [s.name for s in few]
    g = torch.Generator().manual_seed(k)
    for t in (1, 3, 5, 7):
        xv = torch.randn(t, k, generator=g)
        launches.clear()
        ours = prog.run({"x": xv}, None, None)
        if t <= 4:  # only the few-rows kernels (and the joint's epilogue, when it did not fuse)
            assert launches and all(n.startswith(("gemv_", "pointwise")) for n in launches), launches
        for o, w in zip(ours, want(xv, None)):
            assert o.shape == w.shape and rel_err(o, w) <= 1e-4, (t, rel_err(o, w))


def test_the_no_norm_cases_reach_every_tiling_of_the_sub_group_loop(tmp_path):
    """The cases above reach sub-groups smaller than the group (per channel, groups of 3 x 2^n) and equal to it,
    a partial last K tile, and K loops of several steps (else a branch of _dequant.j2's sub_loop would go untested)."""
    seen = set()
    for kind, bits, k, group, offsets in NO_NORM:
        graph, _ = _build(kind, bits, k, group, offsets, norm=False)
        gen, _ = build_program(graph, tmp_path / f"{kind}{bits}{k}{group}", launch=LAUNCH, gemv_max_tokens=4, gemv_dot_max_tokens=0)
        for spec in gen.kernels.values():
            c = spec.constexprs
            if spec.name.startswith("gemv_") and "SUB" in c:
                seen |= {"sub < group"} if c["SUB"] < c["G"] else {"sub = group"}
                seen |= {"partial tile"} if k % c["BLOCK_K"] else set()
                seen |= {"several steps"} if k > c["BLOCK_K"] * c["UNROLL"] else set()
    assert seen == {"sub < group", "sub = group", "partial tile", "several steps"}, seen


@pytest.mark.parametrize("block_k,block_n", [(96, 4), (48, 6), (256, 12)])
def test_a_launch_config_off_the_powers_of_two_still_reads_every_column(tmp_path, block_k, block_n):
    """launch.gemv_wq may come from a tuning file or a user override with any int: BLOCK_K 96 (one 64-wide sub-group
    per tile would skip the next 32 columns) and odd BLOCK_N are taken down to powers of two, never run as given."""
    launch = {**LAUNCH, "gemv_wq": {"num_warps": 4, "BLOCK_N": block_n, "BLOCK_K": block_k, "UNROLL": 2, "num_stages": 1}}
    for kind, bits, k, group, offsets in (("single", 8, 192, 64, True), ("single", 4, 192, 32, False),
                                          ("siblings", 4, 192, 64, True)):
        graph, want = _build(kind, bits, k, group, offsets, norm=False)
        gen, prog = build_program(graph, tmp_path / f"{kind}{bits}{group}{block_k}", launch=launch, gemv_max_tokens=4,
                                  gemv_dot_max_tokens=0)
        for spec in gen.kernels.values():
            if "SUB" in spec.constexprs:
                bk, bn = spec.constexprs["BLOCK_K"], spec.constexprs["BLOCK_N"]
                assert bk & (bk - 1) == 0 and bn & (bn - 1) == 0 and bk % spec.constexprs["SUB"] == 0, spec.constexprs
        g = torch.Generator().manual_seed(k)
        for t in (1, 3):
            xv = torch.randn(t, k, generator=g)
            for o, w in zip(prog.run({"x": xv}, None, None), want(xv, None)):
                assert rel_err(o, w) <= 1e-4, (kind, bits, group, t, rel_err(o, w))


def test_the_pdl_trigger_is_the_launch_configs_and_a_bad_one_is_refused_by_name(tmp_path):
    """launch.gemv_wq's PDL_TRIGGER picks the sub-group kernel's trigger (1: right after its wait, 2: as its programs
    exit); it never changes what the kernel computes, and a value from a bad tuning file or override is refused."""
    graph, want = _build("single", 4, 192, 64, True, norm=False)
    sources = {}
    for trigger in (1, 2):
        launch = {**LAUNCH, "gemv_wq": {**LAUNCH["gemv_wq"], "PDL_TRIGGER": trigger}}
        gen, prog = build_program(graph, tmp_path / f"t{trigger}", launch=launch, gemv_max_tokens=4, gemv_dot_max_tokens=0)
        (spec,) = [s for s in gen.kernels.values() if "SUB" in s.constexprs]
        sources[trigger] = spec.source
        xv = torch.randn(1, 192, generator=torch.Generator().manual_seed(trigger))
        for o, w in zip(prog.run({"x": xv}, None, None), want(xv, None)):
            assert rel_err(o, w) <= 1e-4
    assert "gdc_launch_dependents()" in sources[1] and "gdc_launch_dependents()" not in sources[2]
    assert sources[2].count("gdc_wait()") == 1
    bad = {**LAUNCH, "gemv_wq": {**LAUNCH["gemv_wq"], "PDL_TRIGGER": 0}}
    with pytest.raises(Unlowerable, match=r"^launch config .*PDL_TRIGGER is 1 .* or 2 .*not 0; fix the tuning file"):
        build_program(graph, tmp_path / "bad", launch=bad, gemv_max_tokens=4, gemv_dot_max_tokens=0)
