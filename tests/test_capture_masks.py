"""Per-layer masks come from what HF actually applies, and capture refuses to be silently wrong.

EXAONE-4 sets ``sliding_window`` on every attention module but its global layers pass none
(and apply a full causal mask); ModernBERT's local layers apply a two-sided window while
passing a one-sided ``sliding_window`` argument. Both must match HF's eager forward past the
window. A capture whose graph is wrong (one op's reference patched) must be refused by the
self-check, naming the first differing layer and the length.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import transformers as T
from transformers import masking_utils as mu

from portlayer.flatten import capture, interpret
from portlayer.flatten.hf_masks import infer_mask_spec
from portlayer.flatten.ops import get_op
from portlayer.flatten.selfcheck import SelfCheckError, self_check

COMMON = dict(vocab_size=128, max_position_embeddings=128)


def _exaone4():
    cfg = T.Exaone4Config(**COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, sliding_window=4, sliding_window_pattern=4)
    return T.Exaone4ForCausalLM(cfg)


def _modernbert():
    cfg = T.ModernBertConfig(**COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, local_attention=8, global_attn_every_n_layers=3,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    return T.ModernBertModel(cfg)


def _hf(model, ids):
    with torch.no_grad():
        out = model(ids[None])
    return (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state)[0]


@pytest.fixture(scope="module")
def captured_masks():
    out = {}
    for build in (_exaone4, _modernbert):
        torch.manual_seed(0)
        model = build().eval()
        out[build.__name__] = (model, capture(model))
    return out


@pytest.mark.parametrize("build, windows, causal", [
    ("_exaone4", [4, 4, 4, None], True),        # the global layer's module still says sliding_window=4
    ("_modernbert", [None, 5, 5], False),        # two-sided: |q - k| <= local_attention // 2
])
def test_layer_masks_match_hf_past_the_window(captured_masks, build, windows, causal):
    model, g = captured_masks[build]
    attn = g.find("attention")
    assert [n.attrs["sliding_window"] for n in attn] == windows
    assert all(n.attrs["causal"] is causal for n in attn)
    model.set_attn_implementation("eager")
    gen = torch.Generator().manual_seed(0)
    for length in (1, 9, 40):
        ids = torch.randint(3, 128, (length,), generator=gen)
        assert (interpret(g, ids) - _hf(model, ids)).abs().max().item() <= 1e-4, length


def _windowless_attention(monkeypatch):
    """A deliberately wrong attention semantics: ignores every sliding window."""
    op = get_op("attention")
    ref = op.ref_fn

    def wrong(*args, **kw):
        kw["sliding_window"] = None
        return ref(*args, **kw)

    wrong_op = dataclasses.replace(op, ref_fn=wrong)
    interp = importlib.import_module("portlayer.flatten.interpret")
    real_get = interp.get_op
    monkeypatch.setattr(interp, "get_op", lambda name: wrong_op if name == "attention" else real_get(name))


def test_broken_capture_is_refused_naming_layer_and_length(monkeypatch):
    """capture(verify=False) warns and hands the broken graph back; the check capture runs
    by default (self_check) refuses it, naming the first differing layer and the length."""
    torch.manual_seed(0)
    model = _exaone4().eval()
    _windowless_attention(monkeypatch)
    with pytest.warns(UserWarning, match="self-check skipped"):
        g = capture(model, verify=False)
    with pytest.raises(SelfCheckError, match=r"at 9 tokens; first differing output: layer model\.layers\.0 "):
        self_check(g, model)


@pytest.mark.parametrize("fn, expect", [
    (mu.causal_mask_function, (True, None)),
    (mu.sliding_window_causal_mask_function(7), (True, 7)),
    (mu.bidirectional_mask_function, (False, None)),
    (mu.sliding_window_bidirectional_mask_function(3), (False, 4)),
])
def test_mask_spec_from_hf_mask_functions(fn, expect):
    spec = infer_mask_spec(fn, 512)
    assert spec.error is None and (spec.causal, spec.sliding_window) == expect


def test_chunked_mask_is_reported_not_approximated():
    spec = infer_mask_spec(mu.chunked_causal_mask_function(16, torch.zeros(1, dtype=torch.long)), 512)
    assert spec.error and "chunked" in spec.error
