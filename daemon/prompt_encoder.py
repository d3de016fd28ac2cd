"""Prompts to token ids, off the daemon's loop thread.

Tokenising a large prompt or rendering a chat template takes up to a second of CPU; on the loop
thread that second would freeze every other client's stream (a probe froze it for 19 s with five
1M-character prompts). So requests are encoded on a worker thread (the tokenizers library releases
the GIL while it encodes), and the server picks the results up when they are done.

Before any tokenising, a prompt whose UTF-8 size alone proves it cannot fit is refused: no token of
the vocabulary stands for more than ``max_token_bytes`` bytes of text, so a prompt of more than
``max_request_tokens * max_token_bytes`` bytes needs more tokens than the context holds. The check
is exact in that direction only (it never refuses a prompt that fits), and it bounds the work one
request can cost the worker.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from llmd.daemon.tokenizer import chat_token_ids, has_chat_template
from llmd.daemon.tool_calls import call_style, template_messages
from llmd.protocol import (MAX_DETOKENIZE_IDS, ErrorCode, ProtocolError, parse_messages, parse_prompt,
                           parse_token_ids)

# NOTE: a normaliser (NFKC...) can shrink text before tokenising (a 4-byte character becoming one
# byte at worst), so for such tokenizers the byte bound is scaled by that much.
_NORMALISER_SHRINK = 4


def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes of text any one token stands for (an upper bound)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    most = 1
    # NOTE: the Rust decoder (the same texts: transformers' decode of a fast tokenizer without clean-up
    # is this call), 512 tokens at a time. transformers' batch_decode of the whole vocabulary at once
    # held the GIL for ~280 ms on the default model's 49k tokens, mostly in a full garbage collection
    # its 49k lists set off: every step of the models being served stalled that long while another
    # model answered its first request. Fewer lists than the collector's first threshold (700),
    # freed before the next, never set it off.
    for first in range(0, len(tokenizer), 512):
        ids = [[i] for i in range(first, min(first + 512, len(tokenizer)))]
        texts = backend.decode_batch(ids, skip_special_tokens=False) if backend is not None else \
            tokenizer.batch_decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        most = max(most, *(len(t.encode("utf-8", "surrogatepass")) for t in texts))
    if backend is None or backend.normalizer is not None:
        most *= _NORMALISER_SHRINK
    return max(1, most)


class PromptEncoder:
    """Encodes ``generate`` and ``tokenize`` contents (exactly one of ``prompt``, ``messages``,
    ``token_ids``) on one worker thread, and decodes ``detokenize``'s ids there too.

    Args:
        tokenizer: the model's transformers tokenizer.
        max_request_tokens: the most tokens one request can hold (context and KV pool).
    """

    def __init__(self, tokenizer: Any, max_request_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_request_tokens = max_request_tokens
        self._max_bytes: int | None = None  # found on the worker, at the first request
        # how the model writes tool calls, None if its template renders no tools (a millisecond: now)
        self.tool_style = call_style(tokenizer)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="llmd-encode")

    def submit(self, content: dict[str, Any], tools: list[dict[str, Any]] | None = None) -> Future[list[int]]:
        """Start encoding (with ``tools`` for the chat template: checked ones, daemon/tool_calls.py);
        the future's result is the token ids, or it raises :class:`ProtocolError` (``bad_request``
        for a malformed prompt, refused template or a model that cannot take tools, ``too_long``
        when the prompt cannot fit)."""
        return self._pool.submit(self.encode, content, tools)

    def submit_pieces(self, content: dict[str, Any]) -> Future[list[str]]:
        """Start a ``detokenize``: the future's result is each token's text (see :meth:`pieces`)."""
        return self._pool.submit(self.pieces, content)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    @property
    def max_prompt_bytes(self) -> int:
        """Beyond this many bytes of UTF-8 a prompt cannot fit (see the module's docstring)."""
        with self._lock:
            if self._max_bytes is None:
                self._max_bytes = self.max_request_tokens * max_token_bytes(self.tokenizer)
            return self._max_bytes

    def encode(self, content: dict[str, Any], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The token ids of a request's prompt (synchronously; :meth:`submit` runs this)."""
        sources = [k for k in ("prompt", "messages", "token_ids") if k in content]
        if len(sources) != 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "give exactly one of prompt, messages, token_ids")
        if "token_ids" in content:
            value = content["token_ids"]
            if isinstance(value, list) and len(value) > self.max_request_tokens:
                raise self._too_long(f"{len(value)} token ids")
            return parse_token_ids(value)
        if "messages" in content:
            messages = parse_messages(content["messages"])
            self._check_bytes(sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages))
            if not has_chat_template(self.tokenizer):
                raise ProtocolError(ErrorCode.BAD_REQUEST, "this model has no chat template; send a prompt")
            if tools is not None and self.tool_style is None:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "this model's chat template does not render tools, so "
                                                          "it cannot call them; send the request without tools")
            try:
                return chat_token_ids(self.tokenizer, template_messages(messages), tools)
            except ValueError as e:
                raise ProtocolError(ErrorCode.BAD_REQUEST, str(e)) from None
        prompt = parse_prompt(content["prompt"])
        self._check_bytes(len(prompt.encode("utf-8", "surrogatepass")))
        return [int(t) for t in self.tokenizer.encode(prompt)]

    def pieces(self, content: dict[str, Any]) -> list[str]:
        """Each of ``content["token_ids"]``'s text on its own (a token that is part of a UTF-8
        character reads as U+FFFD, as the OpenAI API shows it)."""
        ids = parse_token_ids(content.get("token_ids"), MAX_DETOKENIZE_IDS)
        if not all(0 <= t < 2**31 for t in ids):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "token ids must be in [0, 2**31)")
        try:
            return [self.tokenizer.decode([t]) for t in ids]
        except (ValueError, TypeError, OverflowError) as e:  # an id past the vocabulary, in some tokenizers
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"cannot decode those token ids: {e}") from None

    def _check_bytes(self, num_bytes: int) -> None:
        if num_bytes > self.max_prompt_bytes:
            raise self._too_long(f"{num_bytes} bytes of text")

    def _too_long(self, what: str) -> ProtocolError:
        return ProtocolError(ErrorCode.TOO_LONG, f"the prompt ({what}) cannot fit: this model holds at most "
                                                 f"{self.max_request_tokens} tokens per request; shorten it")
