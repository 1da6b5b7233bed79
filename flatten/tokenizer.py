"""A byte-level tokenizer for the tiny example models (no vocabulary files to download)."""

from __future__ import annotations

from pathlib import Path


def write_byte_tokenizer(directory: Path, vocab_size: int = 256) -> None:
    """Save a tokenizers byte-level BPE with no merges: each UTF-8 byte is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab = {k: v for k, v in vocab.items() if v < vocab_size}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.save_pretrained(str(directory))
