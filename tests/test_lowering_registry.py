"""The lowering registry: every registered implementation carries a lowering, and each lowering's
code, run on random inputs, matches an independent formula for its op.

The inputs and expected outputs are the op cases of tests/test_ops.py (written out by hand or
with plain torch, never by the code under test). For each implementation we take the cases its
predicates accept, build a one-node graph whose node is forced onto that implementation, let the
fuse and memory-plan passes make its kernel group and buffers, generate the program through the
registry, and run it: Triton under TRITON_INTERPRET=1, CANN calls on the CPU emulator of
torch_npu, torch directly. Half-precision-only calls (CANN) get the case's inputs in float16.
"""

from __future__ import annotations

import pytest
import torch
from test_ops import CASES
from triton_harness import use_interpreter

from portlayer.backends.impls import RegistryError, all_impls, implementation
from portlayer.capabilities.descriptor import load_descriptor
from portlayer.flatten.ir import GraphBuilder, TensorType

DESCRIPTORS = {"triton": "nvidia-h200", "torch": "cpu-x86_64", "cann": "ascend-910b"}
FALLBACK_DESCRIPTOR = {"torch.view": "nvidia-h200", "vendor_gemm": "nvidia-h200"}


def _descriptor(impl):
    for name in [FALLBACK_DESCRIPTOR.get(impl.name), DESCRIPTORS[impl.family], *DESCRIPTORS.values()]:
        if name is None:
            continue
        d = load_descriptor(name)
        if impl.trait("fallback") or impl.supported(d)[0]:
            return d
    return None


def _half(case):
    """The case in float16 (inputs and expectation), for calls that take only fp16/bf16."""
    def cast(x):
        return x.half() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def cast_t(t):
        return t.with_dtype("float16") if t is not None and t.dtype == "float32" else t

    return ([cast_t(t) for t in case.types], [cast(v) for v in case.values], [cast_t(t) for t in case.want_types],
            [cast(w) for w in case.want], 2e-2)


def _graph(op, types, values, attrs):
    b = GraphBuilder()
    ins, feeds = [], {}
    streams = [i for i, t in enumerate(types) if t is not None and t.shape and str(t.shape[0]) == "num_tokens"]
    first = next((i for i, t in enumerate(types) if t is not None), None) if not streams else None
    for i, (t, v) in enumerate(zip(types, values)):
        if t is None:
            ins.append(None)
        elif i == first or i in streams:
            ins.append(b.add_input(f"in{i}", TensorType(t.dtype, tuple(t.shape))))
            feeds[f"in{i}"] = v
        else:
            ins.append(b.add_param(f"p{i}", v))
    outs = b.add(op, ins, attrs)
    b.graph.outputs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    return b.graph, feeds


def _accepted(impl, graph) -> bool:
    """What select asks: the node fits the predicates, the lowering takes it alone, a fused vendor
    call finds its pattern."""
    from portlayer.backends.impls import GraphView

    node, view = graph.nodes[0], GraphView(graph)
    if impl.trait("fallback"):
        return True
    if not impl.supports(node, view.types)[0]:
        return False
    if impl.match is not None:
        return impl.match(node, view)[0] is not None
    return impl.accepts(view, [node])[0]


def _variants(impl, desc):
    """(types, values, want_types, want, tol, ctx) of the cases ``impl`` accepts on ``desc``."""
    out = []
    for c in CASES:
        if c.op != impl.op or (c.ctx is not None and getattr(c.ctx, "kv_cache", None) is not None):
            continue
        if impl.family == "triton" and any(t is not None and t.dtype == "bfloat16" for t in [*c.types, *c.want_types]):
            continue  # the interpreter rounds to bfloat16 by truncation; bf16 kernels are checked on the GPU
        if any(t is not None and t.shape and isinstance(t.shape[0], str) and t.shape[0] != "num_tokens"
               for t in c.types):
            continue  # a leading dim other than the token stream (2*num_tokens): an inference case, not a program
        half = any(t is not None and t.dtype in ("float16", "bfloat16") for t in [*c.types, *c.want_types])
        for variant in ((c.types, c.values, c.want_types, c.want, 2e-2 if half else max(c.atol, 1e-4)), _half(c)):
            try:
                graph, _ = _graph(c.op, variant[0], variant[1], c.attrs)
            except (ValueError, TypeError, KeyError):
                continue
            if _accepted(impl, graph):
                out.append((c.id, *variant, c.ctx))
                break
    return out


def _run(impl, desc, types, values, attrs, ctx, tmp_path):
    from portlayer.backends.generate import generate
    from portlayer.capabilities.policy import plan_for_graph
    from portlayer.codegen.program import load_program, write_program
    from portlayer.passes.context import PassContext
    from portlayer.passes.fuse import fuse
    from portlayer.passes.memory_plan import memory_plan

    graph, feeds = _graph(impl.op, types, values, attrs)
    graph.nodes[0].meta.update(impl=impl.name, impl_family=impl.family)
    plan = plan_for_graph(graph, desc)
    pctx = PassContext(desc, plan, {})
    g = memory_plan(fuse(graph, pctx), pctx)
    (group,) = [k for k in g.meta["kernels"] if graph.nodes[0].name in k["nodes"]]
    assert group["impl"] == impl.name  # the group names the implementation; codegen calls its lowering
    # triton.gemm: reach the template even where the descriptor's crossover picks the vendor GEMM
    gen = generate(g, plan, desc, gemm_max_tokens=(1 << 30) if impl.name == "triton.gemm" else None)
    write_program(gen, tmp_path)
    options = {}
    if desc.codegen == "cann":
        from portlayer.backends.ascend_emulator import AscendEmulator

        options["npu"] = AscendEmulator()
    prog = load_program(tmp_path, g.weights, "cpu", **options)
    from portlayer.flatten.op_defs.attention import AttentionMetadata

    meta = getattr(ctx, "attn_metadata", None) if ctx is not None else None
    if meta is None and (impl.op == "attention" or not feeds or not next(iter(feeds.values())).dim()):
        meta = AttentionMetadata.single(5)  # test_ops binds num_tokens = 5
    return prog.run(feeds, meta, None), gen


def _impl_params():
    seen, params = set(), []
    for impl in all_impls():
        if (impl.name, impl.op) in seen:
            continue
        seen.add((impl.name, impl.op))
        params.append(pytest.param(impl, id=f"{impl.name}:{impl.op}"))
    return params


IMPLS = _impl_params()


def test_every_implementation_has_a_lowering():
    assert IMPLS
    for p in IMPLS:
        impl = p.values[0]
        assert callable(impl.lower) and callable(impl.accepts), impl.name


def test_declaring_an_implementation_without_a_lowering_is_an_error():
    from portlayer.backends import impls as registry

    implementation("relu", name="test.no_lowering", family="torch", priority=-5)  # never applied to a lowering
    try:
        with pytest.raises(RegistryError, match="test.no_lowering"):
            registry._load()
    finally:
        registry._PENDING.pop("test.no_lowering", None)
    with pytest.raises(RegistryError, match="must be a function"):
        implementation("relu", name="test.bad", family="torch", priority=-5)(42)
    registry._PENDING.pop("test.bad", None)


#: implementations whose op has no case their predicates accept in tests/test_ops.py; each is
#: exercised by the named test instead (paged KV caches, fused vendor patterns, model-sized shapes)
ELSEWHERE = {
    ("cann._npu_paged_attention", "attention"): "tests/test_ascend_program.py (decode through the paged cache)",
    ("cann.npu_add_rms_norm", "rms_norm"): "tests/test_ascend_program.py (residual add + norm of a model)",
    ("cann.npu_mrope", "rope"): "tests/test_ascend_program.py (head_dim 64 Qwen3, the q/k pair)",
    ("cann._npu_rotary_embedding", "rope"): "tests/test_ascend_program.py (the q/k pair of tiny models)",
    ("cann.npu_swiglu", "mul"): "tests/test_ascend_program.py (gate|up halves)",
    ("cann.npu_fused_infer_attention_score", "attention"): "tests/test_ascend_program.py (head_dim 64 Qwen3)",
    ("triton.gemm_wq", "linear_wq"): "tests/test_triton_interp_kernels.py::test_weight_only_quantized_gemm",
    ("cann.npu_weight_quant_batchmatmul", "linear_wq"): "emits the reference op (docs/ascend.md): same as 'reference'",
}


@pytest.mark.interpreter
@pytest.mark.parametrize("impl", IMPLS)
def test_lowering_matches_the_op(impl, tmp_path, monkeypatch):
    desc = _descriptor(impl)
    assert desc is not None, f"no shipped descriptor supports {impl.name}"
    variants = _variants(impl, desc)
    if not variants:
        assert (impl.name, impl.op) in ELSEWHERE, (
            f"{impl.name} ({impl.op}) accepts none of the op's cases in tests/test_ops.py; add a case it takes, "
            "or name the test that covers it in ELSEWHERE")
        return
    if impl.family == "triton":
        use_interpreter(monkeypatch)
    for case_id, types, values, want_types, want, tol, ctx in variants:
        attrs = next(c.attrs for c in CASES if c.id == case_id)
        outs, gen = _run(impl, desc, types, values, attrs, ctx, tmp_path / case_id)
        if impl.family == "triton" and impl.op not in ("reshape",):
            assert gen.kernels, f"{impl.name}: no kernel generated"
        for o, w, wt in zip(outs, want, want_types):
            assert tuple(o.shape) == tuple(w.shape), (case_id, o.shape, w.shape)
            assert str(o.dtype) == f"torch.{wt.dtype}", (case_id, o.dtype, wt)
            torch.testing.assert_close(o.to(w.dtype), w, atol=tol, rtol=tol, equal_nan=True,
                                       msg=lambda m, cid=case_id: f"{impl.name} on {cid}: {m}")
