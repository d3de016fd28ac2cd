"""Streaming detokenizer: deltas concatenate to the full decode and never split a character."""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_tokenizer

from llmd.daemon.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello, world!", "naïve café 😀👍🏽 done", "日本語のテキスト", "mixed 中文 and emoji 🎉 end"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_deltas_are_whole_characters(text: str) -> None:
    tok = make_tiny_tokenizer()  # one token per byte: every multi-byte character is split
    ids = tok.encode(text)
    assert len(ids) > len(text) or text.isascii()
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    for d in deltas:
        assert "\ufffd" not in d


def test_default_tokenizer_deltas(default_model_path) -> None:
    from llmd.daemon.model_source import ModelSource
    from llmd.daemon.tokenizer import load_tokenizer

    tok = load_tokenizer(ModelSource("gguf", default_model_path, "default"))
    for text in TEXTS:
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok)
        assert detok._decode_ids == tok.backend_tokenizer.decode  # the Rust decode, straight (no space clean-up)
        deltas = [detok.push(i) for i in ids]
        assert "".join(deltas) + detok.flush() == tok.decode(ids)  # transformers' decode, the reference
        assert all("\ufffd" not in d for d in deltas)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers() -> None:
    """transformers' clean-up (spaces before punctuation) is not in the backend's decode: such a
    tokenizer keeps transformers' decode, whose text is the reference."""
    tok = make_tiny_tokenizer()
    tok.clean_up_tokenization_spaces = True
    detok = IncrementalDetokenizer(tok)
    assert detok._decode_ids == tok.decode
    ids = tok.encode("a , b .")
    assert "".join(detok.push(i) for i in ids) + detok.flush() == tok.decode(ids)
