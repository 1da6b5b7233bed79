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
