"""The prompt encoder's byte bound (daemon/prompt_encoder.py): the most bytes one token stands for,
computed by the Rust decoder a chunk at a time, against transformers' decode of every token."""

from __future__ import annotations

import random

from tiny_models import make_tiny_tokenizer

from llmd.daemon.prompt_encoder import _NORMALISER_SHRINK, max_token_bytes


def reference(tokenizer) -> int:
    """The bound as transformers decodes each token (no clean-up, special tokens kept)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    most = max(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    return most * (_NORMALISER_SHRINK if tokenizer.backend_tokenizer.normalizer is not None else 1)


def word_tokenizer(size: int, longest_at: int):
    """A word-level fast tokenizer of ``size`` words of 1-6 characters, some of them 2-4 bytes long,
    and one 40-character word at id ``longest_at``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzéßжш中文🙂"
    words = {"[UNK]"}
    while len(words) < size - 1:
        words.add("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))))
    vocab = {w: i for i, w in enumerate(sorted(words))}
    longest = "🙂" * 40
    vocab[longest] = size - 1
    vocab = {w: (longest_at if i == size - 1 else size - 1 if i == longest_at else i) for w, i in vocab.items()}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_the_byte_bound_is_transformers_decode_s() -> None:
    tiny = make_tiny_tokenizer()
    # (its bytes are one byte each; its special tokens' texts are the longest: a bound of 1 is wrong)
    assert max_token_bytes(tiny) == reference(tiny) > 1
    # a vocabulary of several of the chunks the bound is computed in, its longest token in a middle one
    # and in the last, partial one
    for at in (1700, 2999):
        words = word_tokenizer(3000, longest_at=at)
        assert max_token_bytes(words) == reference(words) == 160
