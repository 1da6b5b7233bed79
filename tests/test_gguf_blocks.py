"""GGUF block formats kept natively: decoded into linear_wq, checked against gguf's own dequantizer."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from portlayer.flatten.gguf_blocks import decode
from portlayer.flatten.gguf_source import _unpermute_index
from portlayer.flatten.op_defs.quant import linear_wq


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
def test_native_blocks_equal_gguf_dequantize(fmt):
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((24, 96)) * 0.05 + 0.01).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)  # bytes as a GGUF file stores them
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(24, 96).copy())
    nw = decode(fmt, raw, 24, 96)
    assert nw.group_size == 32 and nw.bits == (8 if fmt == "Q8_0" else 4)
    assert (nw.offsets is not None) == (fmt == "Q4_1")
    torch.testing.assert_close(nw.dequantized(), ref, atol=1e-6, rtol=1e-6)
    x = torch.randn(5, 96)
    got = linear_wq(x, nw.qweight, nw.scales, None, nw.offsets, bits=nw.bits, group_size=32)
    torch.testing.assert_close(got, x @ ref.T, atol=1e-5, rtol=1e-5)


def test_llama_qk_unpermute_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.arange(12 * 4, dtype=np.float32).reshape(12, 4)
    proc = LlamaTensorProcessor(config={"num_attention_heads": 3, "num_key_value_heads": 3})
    ref = proc.process(w, "blk.0.attn_q.weight").weights
    got = torch.from_numpy(w)[_unpermute_index(12, 3)]
    assert np.array_equal(got.numpy(), ref)
