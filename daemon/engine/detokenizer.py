"""Incremental detokenizer: token ids in, text deltas out, never splitting a character.

Byte-level BPE tokenizers split multi-byte characters (emoji, CJK) across tokens; decoding a
partial character yields U+FFFD. We decode a short window of recent tokens and hold text back
while it ends in U+FFFD, so every delta is whole UTF-8 text. Decoding the window relative to a
prefix also keeps the leading-space rules of SentencePiece-style tokenizers right.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # tokens before this have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text):]
