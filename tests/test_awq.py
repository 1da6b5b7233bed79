"""AWQ scaling (passes/awq.py) and GPTQ act-order: the fold keeps HF's float function, the
scaled/ordered quantizers lower the layer output error against the float product."""

from __future__ import annotations

import torch
from conftest import hf_forward, hf_model

from portlayer.flatten import interpret
from portlayer.flatten.op_defs.quant import dequantize


def _outlier_layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w [64, 256] and activations x [512, 256] whose 6 channels are 30x larger (as in LLMs)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 256, generator=gen) * 0.05
    x = torch.randn(512, 256, generator=gen)
    x[:, torch.randperm(256, generator=gen)[:6]] *= 30
    return w, x


def test_awq_scale_lowers_output_error_with_outlier_activations():
    from portlayer.passes.awq import search_scale
    from portlayer.passes.gptq import rtn

    w, x = _outlier_layer()
    s, alpha = search_scale(w, x.T.double() @ x.double(), 512, 4, 128, False)
    q, sc, off = rtn(w * s, 4, 128, False)
    w_awq = dequantize(q, sc, 8, 128, off) / s  # int8 codes in -8..7: the 4-bit values unpacked
    q0, sc0, off0 = rtn(w, 4, 128, False)
    w_rtn = dequantize(q0, sc0, 8, 128, off0)
    ref = x @ w.T
    err_awq, err_rtn = (x @ w_awq.T - ref).norm(), (x @ w_rtn.T - ref).norm()
    assert alpha > 0 and err_awq < 0.9 * err_rtn, (alpha, float(err_awq), float(err_rtn))


def test_gptq_act_order_keeps_groups_contiguous_and_beats_rtn():
    from portlayer.passes.gptq import gptq, rtn

    w, x = _outlier_layer(1)
    q, sc, off = gptq(w, x.T.double() @ x.double(), 512, 4, 64, False, act_order=True)
    assert sc.shape == (64, 4) and int(q.min()) >= -8 and int(q.max()) <= 7
    w_q = dequantize(q, sc, 8, 64, off)  # the linear_wq contract: group j = columns 64j..64j+63
    q0, sc0, off0 = rtn(w, 4, 64, False)
    ref = x @ w.T
    assert (x @ w_q.T - ref).norm() < 0.8 * (x @ dequantize(q0, sc0, 8, 64, off0).T - ref).norm()


def test_awq_fold_leaves_hf_logits_unchanged(captured, tiny_dirs):
    """Scales folded into the norms / up_proj rows (no quantization): the graph still computes HF's logits."""
    from portlayer.passes.awq import apply_scale, fold_target

    g = captured["tiny-qwen3"].copy()
    g.weights = dict(g.weights)
    groups: dict[str, list[int]] = {}
    for i, n in enumerate(g.nodes):
        if n.op == "linear" and n.name != "lm_head":
            groups.setdefault(n.inputs[0], []).append(i)
    gen = torch.Generator().manual_seed(3)
    folded = {"norm": 0, "rows": 0}
    for idx in groups.values():
        where = fold_target(g, idx)
        if where is not None:
            k = int(g.weights[g.nodes[idx[0]].inputs[1]].shape[1])
            apply_scale(g, idx, where, torch.rand(k, generator=gen) * 3 + 0.25)
            folded[where[0]] += 1
    layers = sum(1 for n in g.nodes if n.op == "attention")
    assert folded == {"norm": 2 * layers, "rows": layers}  # q/k/v and gate/up at the norms, down at up_proj
    ids = torch.randint(0, 256, (10,), generator=gen)
    ref = hf_forward(hf_model(tiny_dirs["tiny-qwen3"]), ids)
    assert (interpret(g, ids) - ref).abs().max() < 1e-4


def test_int4_awq_gptq_pipeline_close_to_hf(captured, tiny_dirs):
    """The whole int4 AWQ + GPTQ (act-order) path through the pipeline stays close to HF's logits.
    A random-weight model has no activation outliers for AWQ to protect and calibrates on seeded
    random ids, so this guards correctness (a wrong fold gives cosine ~0), not the gain: the gain
    is measured on SmolLM2 (docs/quantization.md)."""
    from portlayer.passes.pipeline import run_pipeline

    ids = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(7))
    ref = hf_forward(hf_model(tiny_dirs["tiny-qwen3"]), ids)
    res = run_pipeline(captured["tiny-qwen3"], "cpu-x86_64", overrides={"weight_quantization": "int4"},
                       options={"quant_method": "awq+gptq", "act_order": True})
    meta = res.graph.meta["quantization"]
    assert meta["awq_scaled_layers"] == 2 * 6 and "AWQ scales + GPTQ (act-order)" in meta["method"]
    got = interpret(res.graph, ids)
    assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) >= 0.98


def test_output_error_clip_search_beats_weight_error_clip_on_the_layer_output():
    """rtn with the input Gram blocks picks each group's clip by the layer's output error on the
    calibration inputs; graded on held-out inputs of the same distribution, against torch matmuls."""
    from portlayer.passes.gptq import gram_blocks, rtn

    w, x = _outlier_layer(2)
    fit, held = x[:256], x[256:]  # fitted on the first half, graded on the second
    h = gram_blocks(fit.T.double() @ fit.double(), 256, 64)
    assert torch.allclose(h[1], (fit[:, 64:128].T @ fit[:, 64:128]) / 256, rtol=1e-4, atol=1e-4)
    errs = {}
    for name, hb in (("weight", None), ("output", h)):
        q, sc, off = rtn(w, 4, 64, False, hb)
        errs[name] = float((held @ (dequantize(q, sc, 8, 64, off) - w).T).norm())
    assert errs["output"] < 0.97 * errs["weight"], errs


def test_awq_fold_into_a_quantized_producer_is_exact(captured):
    """True-sequential AWQ folds down_proj's 1/s into an up_proj that is already linear_wq: its rows'
    scales and offsets are divided, which must leave the graph's outputs unchanged (vs. torch on
    the unfolded graph)."""
    from portlayer.flatten.ir import Node, TensorType
    from portlayer.passes.awq import apply_scale, fold_target
    from portlayer.passes.pipeline import run_pipeline

    g = run_pipeline(captured["tiny-qwen3"], "cpu-x86_64", overrides={"weight_quantization": "int4"},
                     options={"quant_method": "rtn"}).graph
    g.weights = dict(g.weights)
    ids = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(4))
    before = interpret(g, ids)
    downs = [i for i, n in enumerate(g.nodes) if n.op == "linear_wq" and n.name.endswith("down_proj")]
    for i in downs:  # scale the quantized down_proj's input by s: fold 1/s into up_proj, x s into down's dequantized rows
        where = fold_target(g, [i])
        assert where is not None and where[0] == "rows" and g.nodes[where[1]].op == "linear_wq"
        n = g.nodes[i]
        w = dequantize(g.weights[n.inputs[1]], g.weights[n.inputs[2]], 4, n.attrs["group_size"], g.weights[n.inputs[4]])
        s = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(i)) + 0.5
        g.nodes[i] = Node(n.name, "linear", [n.inputs[0], n.inputs[1] + "_float", None], n.outputs, {}, n.meta)
        g.weights[n.inputs[1] + "_float"] = w
        g.params[n.inputs[1] + "_float"] = TensorType("float32", tuple(w.shape))
        apply_scale(g, [i], where, s)
    assert (interpret(g, ids) - before).abs().max() < 1e-4
