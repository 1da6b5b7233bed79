"""select_logit_rows: logits only where sampled, identical to those rows of the full graph."""

from __future__ import annotations

import torch

from portlayer.flatten.interpret import ExecContext, bind_symbols, run_graph
from portlayer.flatten.logits import select_logit_rows
from portlayer.flatten.op_defs.attention import AttentionMetadata
from portlayer.flatten.verify import verify_graph


def test_rows_equal_full_logits_rows(captured):
    g = captured["tiny-qwen3"]
    sel = select_logit_rows(g)
    verify_graph(sel)
    assert sel.outputs and sel.value_types()[sel.outputs[0]].shape == ("num_seqs", 256)
    ids = torch.randint(0, 256, (12,))
    pos = torch.cat([torch.arange(5), torch.arange(7)])
    meta = AttentionMetadata.from_lens([5, 7])
    full_feeds = {"input_ids": ids, "positions": pos}
    full = run_graph(g, full_feeds, ExecContext(bindings=bind_symbols(g, full_feeds), attn_metadata=meta))[0]
    rows = torch.tensor([4, 11])
    feeds = {**full_feeds, "logits_indices": rows}
    b = bind_symbols(sel, feeds)
    out = run_graph(sel, feeds, ExecContext(bindings=b, attn_metadata=meta))[0]
    assert torch.allclose(out, full[rows], atol=1e-5)  # a GEMM of 2 rows may round differently from 12


def test_encoders_are_left_alone(captured):
    g = captured["tiny-bert"]
    assert [v.name for v in select_logit_rows(g).inputs] == [v.name for v in g.inputs]


def test_a_head_behind_a_batch_dim_reshape_gathers_along_the_token_dim():
    """A graph that keeps a [1, tokens, hidden] batch dim up to its last op (lm_head, then a reshape to
    [tokens, vocab]): the rows are still gathered, along the token dim, equal to those rows of the full logits."""
    from portlayer.flatten.ir import Graph, GraphBuilder, TensorType

    torch.manual_seed(0)
    b = GraphBuilder(Graph())
    ids = b.add_input("input_ids", TensorType("int64", ("num_tokens",)))
    b.add_input("positions", TensorType("int64", ("num_tokens",)))
    emb = b.add1("embedding", [b.add_param("embed", torch.randn(32, 16)), ids])
    x = b.add1("reshape", [emb], {"shape": [1, "num_tokens", 16]})
    logits = b.add1("linear", [x, b.add_param("lm_head_weight", torch.randn(32, 16)), None])
    out = b.add1("reshape", [logits], {"shape": ["num_tokens", 32]})
    g = b.graph
    g.outputs = [out]
    g.meta.update(task="causal_lm", token_symbol="num_tokens")
    sel = select_logit_rows(g)
    verify_graph(sel)
    assert sel.value_types()[sel.outputs[0]].shape == ("num_seqs", 32)
    assert next(n for n in sel.nodes if n.op == "index_select").attrs["dim"] == 1  # the token dim of [1, T, 16]
    feeds = {"input_ids": torch.randint(0, 32, (9,)), "positions": torch.arange(9)}
    meta = AttentionMetadata.from_lens([4, 5])
    full = run_graph(g, feeds, ExecContext(bindings=bind_symbols(g, feeds), attn_metadata=meta))[0]
    rows = torch.tensor([3, 8])
    f2 = {**feeds, "logits_indices": rows}
    got = run_graph(sel, f2, ExecContext(bindings=bind_symbols(sel, f2), attn_metadata=meta))[0]
    torch.testing.assert_close(got, full[rows], atol=1e-5, rtol=1e-4)


def test_falcon_linears_written_as_x_at_w_t_are_linear_and_its_logits_are_selected():
    """FalconLinear computes x @ W.T: captured as linear (the GEMM kernels' path, a flat [tokens, ...] stream), its
    logits computed only for the sampled rows; generation equals Hugging Face's."""
    import transformers as T

    from portlayer.flatten import capture
    from portlayer.runtime.engine import LLMEngine
    from portlayer.runtime.sequence import SamplingParams

    torch.manual_seed(0)
    cfg = T.FalconConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         new_decoder_architecture=False, multi_query=True, max_position_embeddings=128)
    model = T.FalconForCausalLM(cfg).eval()
    g = capture(model)
    assert not any(n.op == "matmul" for n in g.nodes) and sum(n.op == "linear" for n in g.nodes) == 9
    sel = select_logit_rows(g)
    assert "logits_indices" in [v.name for v in sel.inputs] and sel.value_types()[sel.outputs[0]].shape == ("num_seqs", 64)
    prompt = [5, 9, 13, 2, 40, 41]
    got = LLMEngine.from_graph(sel).generate([prompt], SamplingParams(temperature=0.0, max_tokens=6,
                                                                      ignore_eos=True))[0].token_ids
    model.set_attn_implementation("eager")  # as tests/test_archs_end_to_end.py compares (capture set its own)
    want = model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == want
