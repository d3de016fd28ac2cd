"""The llmd wire protocol, version 1 (documented in docs/protocol.md).

A message is four ZeroMQ frames, ``[b"llmd/1", signature, header, content]`` (a ROUTER socket sees
the sender's identity frame first). ``header`` and ``content`` are msgpack maps; ``signature`` is
the lowercase hex HMAC-SHA256 of ``header + content`` under the key from the connection file.
Nothing is ever deserialised into live objects or evaluated: msgpack decodes to plain maps, lists, strings and numbers,
and every field is checked before use.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgpack

PROTOCOL = b"llmd/1"
VERSION = 1
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # ZMQ MAXMSGSIZE: a larger frame drops the connection
MAX_ID_CHARS = 64
MAX_PROMPT_CHARS = 1_000_000
MAX_FRAMES = 8  # more than any message has (4, plus the identity and the stats topic); the rest is dropped
# Requests must carry a header ``ts`` within this many seconds of the daemon's clock, and a signed
# message is accepted once within that window: a captured message cannot be replayed later, nor
# again now (the daemon remembers the signatures it saw for as long as they would be accepted).
REPLAY_WINDOW_S = 60.0

# The stats message's ``block_map``: one byte per KV block (docs/protocol.md, Stats).
BLOCK_FREE = 0  # empty, or its prefix was evicted
BLOCK_CACHED = 1  # free, but holding a reusable prefix
BLOCK_SHARED = 2  # in use by more than one request (a prefix-cache hit in flight)
BLOCK_FIRST_OWNER = 3  # 3 + i: in use by requests[i]
BLOCK_OTHER = 255  # in use by a request past the rows the codes can name
MAX_OWNER_ROWS = BLOCK_OTHER - BLOCK_FIRST_OWNER  # 252

REQUEST_TYPES = ("generate", "cancel", "stats", "info", "tokenize", "detokenize", "health", "ping", "shutdown")
REPLY_TYPES = ("accepted", "delta", "done", "error", "stats", "info", "tokens", "pieces", "health", "pong",
               "shutdown", "keepalive")
MAX_DETOKENIZE_IDS = 4096  # one ``detokenize``: a stream's logprobs ask for a few at a time
TOOL_NAME = r"[A-Za-z0-9_.-]{1,64}"  # a tool's (function's) name, as OpenAI's API takes it


class ErrorCode:
    """Typed error codes carried by ``error`` replies."""

    BAD_REQUEST = "bad_request"  # malformed message or invalid field
    TOO_LONG = "too_long"  # prompt + max_tokens beyond the context or the KV pool
    OVERLOADED = "overloaded"  # queue full: retry later
    UNKNOWN_REQUEST = "unknown_request"  # cancel of a request this client does not own / has finished
    SHUTTING_DOWN = "shutting_down"  # daemon is stopping: no new requests
    CANCELLED = "cancelled"  # the daemon ended the request (e.g. shutdown timeout)
    INTERNAL = "internal"  # a failure inside the daemon (e.g. a model step)
    MODEL_NOT_FOUND = "model_not_found"  # the request names a model this daemon cannot serve
    # a remote model's server (config [remote."NAME"], daemon/remote_model.py):
    REMOTE_UNREACHABLE = "remote_unreachable"  # no connection to it (refused, no route, TLS failed)
    REMOTE_TIMEOUT = "remote_timeout"  # it did not connect or stayed silent beyond the table's timeouts
    REMOTE_ERROR = "remote_error"  # it failed (5xx), refused the API key (401/403) or sent a broken stream


class ProtocolError(Exception):
    """A message that cannot be accepted; ``code`` is an :class:`ErrorCode` value."""

    def __init__(self, code: str, message: str, msg_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.msg_id = msg_id  # set when the message was signed and had an id: it can be answered


class SignatureError(ProtocolError):
    """Unsigned or wrongly signed: dropped and counted, never answered."""


@dataclass(slots=True)
class Message:
    type: str
    header: dict[str, Any]
    content: dict[str, Any]

    @property
    def msg_id(self) -> str:
        return self.header.get("id", "")

    @property
    def parent(self) -> str | None:
        return self.header.get("parent")


_counter = itertools.count()
_prefix = os.urandom(4).hex()


def new_msg_id() -> str:
    return f"{_prefix}-{next(_counter)}"


def sign(key: bytes, header: bytes, content: bytes) -> bytes:
    return hmac.new(key, header + content, hashlib.sha256).hexdigest().encode()


def encode(key: bytes, msg_type: str, content: dict[str, Any], parent: str | None = None,
           msg_id: str | None = None) -> list[bytes]:
    """Frames for one message (without any identity frame)."""
    header: dict[str, Any] = {"v": VERSION, "id": msg_id or new_msg_id(), "type": msg_type, "ts": time.time()}
    if parent is not None:
        header["parent"] = parent
    h = msgpack.packb(header, use_bin_type=True)
    c = msgpack.packb(content, use_bin_type=True)
    return [PROTOCOL, sign(key, h, c), h, c]


def decode(key: bytes, frames: list[bytes], allowed_types: tuple[str, ...]) -> Message:
    """Check and parse four frames.

    Raises:
        ProtocolError: wrong frame count or protocol, bad signature (code ``bad_request``), bad
            msgpack, or an unknown type. Callers drop unsigned messages without replying.
    """
    if len(frames) != 4:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"expected 4 frames, got {len(frames)}")
    proto, signature, h, c = frames
    if proto != PROTOCOL:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "unknown protocol; expected llmd/1")
    if not hmac.compare_digest(sign(key, h, c), bytes(signature)):
        raise SignatureError(ErrorCode.BAD_REQUEST, "bad signature")
    header = _unpack(h, "header")
    msg_id = header.get("id")
    if not isinstance(msg_id, str) or not 0 < len(msg_id) <= MAX_ID_CHARS:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "header.id must be a string of 1 to 64 characters")
    try:
        # From here on the sender is authenticated and named the message: errors can be answered.
        content = _unpack(c, "content")
        if header.get("v") != VERSION:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unsupported protocol version {header.get('v')!r}")
        msg_type = header.get("type")
        if msg_type not in allowed_types:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown message type {msg_type!r}")
        parent = header.get("parent")
        if parent is not None and not isinstance(parent, str):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "header.parent must be a string")
    except ProtocolError as e:
        e.msg_id = msg_id
        raise
    return Message(msg_type, header, content)


class ReplayGuard:
    """Accepts each signed message once, and only while its timestamp is fresh.

    Only messages whose signature checked out reach it, so only the key's holders can fill it: its
    size is bounded by the legitimate traffic of one window.
    """

    def __init__(self, window_s: float = REPLAY_WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: set[bytes] = set()
        self._expiry: deque[tuple[float, bytes]] = deque()

    def check(self, msg: Message, signature: bytes, now: float | None = None) -> None:
        """Raises:
            SignatureError: the signature was seen in the window (a replay: dropped, never answered).
            ProtocolError: ``ts`` is missing or outside the window (answered: an honest sender with
                a wrong clock learns why).
        """
        now = time.time() if now is None else now
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(self._expiry.popleft()[1])
        if signature in self._seen:
            raise SignatureError(ErrorCode.BAD_REQUEST, "replayed message")
        ts = msg.header.get("ts")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not abs(now - ts) <= self.window_s:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"header.ts must be the sender's Unix time, within "
                                                      f"{self.window_s:.0f}s of the daemon's clock", msg.msg_id)
        self._seen.add(signature)
        # NOTE: remembered until its ts leaves the window on either side: after that, ts refuses it.
        self._expiry.append((max(now, float(ts)) + self.window_s, signature))


def _unpack(data: bytes, what: str) -> dict[str, Any]:
    try:
        # NOTE: strict_map_key and raw=False keep keys to str/bytes; no ext types are accepted.
        value = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{what} is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(value, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{what} must be a map")
    return value


def require_str(content: dict[str, Any], field: str, max_chars: int = MAX_ID_CHARS) -> str:
    value = content.get(field)
    if not isinstance(value, str) or not 0 < len(value) <= max_chars:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{field} must be a string of 1 to {max_chars} characters")
    return value


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """Validate chat messages: a non-empty list of ``{"role": str, "content": str}``; an assistant's may
    carry ``tool_calls`` (OpenAI's ``[{"id", "type": "function", "function": {"name", "arguments"}}]``,
    its content then may be empty), and a ``tool`` message, the result of one, its ``tool_call_id``."""
    if not isinstance(value, list) or not 0 < len(value) <= 1024:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "messages must be a list of 1 to 1024 messages")
    out = []
    chars = 0
    for m in value:
        if not isinstance(m, dict) or set(m) - {"role", "content", "tool_calls", "tool_call_id"} or \
                not isinstance(m.get("role"), str):
            raise ProtocolError(ErrorCode.BAD_REQUEST, 'each message must be {"role": str, "content": str}')
        content = m.get("content")
        if content is None and "tool_calls" in m:  # a message of calls alone: absent or null content
            content = ""
        if not isinstance(content, str):
            raise ProtocolError(ErrorCode.BAD_REQUEST, 'each message must be {"role": str, "content": str}')
        role = m["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown message role {role!r}")
        message: dict[str, Any] = {"role": role, "content": content}
        if "tool_calls" in m:
            if role != "assistant":
                raise ProtocolError(ErrorCode.BAD_REQUEST, "only an assistant message has tool_calls")
            message["tool_calls"] = _parse_tool_calls(m["tool_calls"])
            chars += sum(len(c["function"]["arguments"]) for c in message["tool_calls"])
        if role == "tool" and not (out and (out[-1]["role"] == "tool" or "tool_calls" in out[-1])):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a message of role tool answers the tool_calls of the "
                                                      "assistant message before it; there is none")
        if "tool_call_id" in m:
            if role != "tool":
                raise ProtocolError(ErrorCode.BAD_REQUEST, "only a tool message has a tool_call_id")
            message["tool_call_id"] = require_str(m, "tool_call_id")
        chars += len(message["content"])
        out.append(message)
    if chars > MAX_PROMPT_CHARS:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"messages exceed {MAX_PROMPT_CHARS} characters")
    return out


def _parse_tool_calls(value: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, as the daemon sent them out (arguments: JSON text)."""
    shape = 'tool_calls must be a list of {"id": str, "type": "function", "function": {"name": str, "arguments": str}}'
    if not isinstance(value, list) or not 0 < len(value) <= 128:
        raise ProtocolError(ErrorCode.BAD_REQUEST, shape)
    calls = []
    for call in value:
        fn = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(fn, dict) or set(call) - {"id", "type", "function"} or call.get("type", "function") !=
                "function" or not isinstance(call.get("id", ""), str) or len(call.get("id", "")) > MAX_ID_CHARS
                or set(fn) != {"name", "arguments"} or not isinstance(fn["name"], str)
                or not re.fullmatch(TOOL_NAME, fn["name"]) or not isinstance(fn["arguments"], str)):
            raise ProtocolError(ErrorCode.BAD_REQUEST, shape)
        calls.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return calls


def parse_token_ids(value: Any, max_len: int = MAX_PROMPT_CHARS) -> list[int]:
    if not isinstance(value, list) or not value or len(value) > max_len:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"token_ids must be a list of 1 to {max_len} integers")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"token_ids must be a list of 1 to {max_len} integers")
    return value


def parse_context_limit(value: Any) -> int | None:
    """``generate``'s optional ``context_limit``: an int >= 2 (a prompt token and an output token)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 2):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"context_limit must be an integer >= 2, got {value!r}")
    return value


def parse_prompt(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_PROMPT_CHARS:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"prompt must be a string of 1 to {MAX_PROMPT_CHARS} characters")
    return value
