"""A model served elsewhere (issue 27): an OpenAI-compatible server (vLLM, SGLang, another llmd) that a
``[remote."NAME"]`` table of the config file names. Requests naming it skip the engine: their
``generate`` becomes the server's ``/chat/completions`` (messages) or ``/completions`` (a prompt),
streamed back as deltas (daemon/remote_runner.py does the HTTP).

This file is what is known of the remote without talking to it: its settings and API key, how a
request translates into the server's body, how each streamed chunk reads, what an HTTP status
means as an llmd error, and the remote's health as the last exchanges left it.

NOTE: the API key is read once, at start, and kept only here: it goes into the ``Authorization``
header and nowhere else (not ``info``, the stats, ``repr`` or the log).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from llmd.config import RemoteTable
from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.tool_calls import ToolRequest, new_call_id
from llmd.errors import LlmdError
from llmd.protocol import ErrorCode, ProtocolError, parse_messages, parse_prompt

# What the server gets of a request's params, as it names them (OpenAI's, and vLLM's and SGLang's
# extensions, which llmd's own server takes too). Only what the request set is sent: the server's
# defaults apply to the rest, as they would for its own clients.
_FORWARDED_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "seed", "stop", "ignore_eos", "response_format")
MAX_ERROR_BODY_BYTES = 64 * 1024  # of an error answer, read for its message
MAX_TOOL_CALLS = 128
MAX_ANSWER_BYTES = 4 << 20  # an answer's text (characters, in fact: ~1M tokens) beyond which its stream is closed
FINISH_REASONS = ("stop", "length", "tool_calls", "abort")


class RemoteModel:
    """Args:
        name: how requests name it (the table's NAME).
        table: its settings.
        api_key: the key its server wants (None: it wants none).
    """

    def __init__(self, name: str, table: RemoteTable, api_key: str | None = None) -> None:
        self.name, self.table, self._api_key = name, table, api_key
        self.health = RemoteHealth()

    def __repr__(self) -> str:  # (no key)
        return f"RemoteModel({self.name!r}, {self.table.url!r}, {self.table.model!r})"

    @classmethod
    def from_table(cls, name: str, table: RemoteTable) -> RemoteModel:
        """Raises:
            LlmdError: its API key's variable is unset or its file unreadable (said at start, not at
                the first request).
        """
        key = cls._read_key(name, table)
        if key is not None and not all(33 <= ord(c) < 127 for c in key):
            # (an HTTP header carries it: httpx would refuse it at each request, quoting it in the error)
            raise LlmdError(f"remote model {name}: its API key must be one word of printable ASCII characters; "
                            f"check {'$' + table.api_key_env if table.api_key_env else table.api_key_file}")
        return cls(name, table, key)

    @staticmethod
    def _read_key(name: str, table: RemoteTable) -> str | None:
        key = None
        if table.api_key_env is not None:
            key = os.environ.get(table.api_key_env, "").strip()
            if not key:
                raise LlmdError(f'remote model {name}: ${table.api_key_env} (its api_key_env) is not set; export it '
                                "where the daemon starts, or use api_key_file")
        elif table.api_key_file is not None:
            try:
                key = Path(table.api_key_file).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as e:
                raise LlmdError(f"remote model {name}: cannot read its api_key_file {table.api_key_file}: "
                                f"{e.strerror if isinstance(e, OSError) else e}") from None
            if not key:
                raise LlmdError(f"remote model {name}: its api_key_file {table.api_key_file} is empty")
        return key

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def scrub(self, text: str) -> str:
        """``text`` without the API key (a server may quote the header it refused)."""
        return text.replace(self._api_key, "[API key]") if self._api_key else text

    @property
    def host(self) -> str:
        """Where it runs (``host:port``), as listings show it."""
        return urlsplit(self.table.url).netloc

    def describe(self) -> dict[str, Any]:
        """Its entry in ``info``'s and the stats' ``models``."""
        return {"name": self.name, "model": self.table.model, "state": "remote", "remote": True, "url": self.table.url,
                "max_model_len": self.table.context_length, "health": self.health.state,
                "health_detail": self.health.detail, "latency_s": self.health.latency_s}

    def info(self, daemon: dict[str, Any]) -> dict[str, Any]:
        """Its ``info`` reply: the daemon's fields, and its own in place of a local model's."""
        own = {"model": self.table.model, "name": self.name, "remote": True, "url": self.table.url,
               "max_model_len": self.table.context_length, "device": "remote", "dtype": None,
               "quantization": None, "weight_bytes": 0, "kv_cache_bytes": 0, "kv_cache_tokens": None,
               "chat_template": True, "tools": True, "sampling_defaults": {}, "health": self.health.state}
        return {**daemon, **own}

    # ---- a request ----------------------------------------------------------------------------------

    def upstream_request(self, content: dict[str, Any], params: SamplingParams, tools: ToolRequest | None,
                         context_limit: int | None) -> tuple[str, dict[str, Any]]:
        """The server's path and body for a ``generate`` (checked by the intake already for its
        common fields; ``params``: its params as the intake checked them), streamed with usage.

        Raises:
            ProtocolError: ``bad_request``: what a remote model cannot take (token ids: they are a
                tokenizer's of this machine; log-probabilities: they come as token ids).
        """
        sources = [k for k in ("prompt", "messages", "token_ids") if k in content]
        if len(sources) != 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "give exactly one of prompt, messages, token_ids")
        if sources[0] == "token_ids":
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{self.name} is a remote model: send it a prompt or messages "
                                                      "(token ids are a local tokenizer's)")
        raw = content.get("params") or {}  # (what the request set: ``params`` is it, checked)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(params, name) is not None:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"{self.name} is a remote model: {name} is not available "
                                                          "for it (they come as this daemon's token ids)")
        if params.stop_token_ids:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{self.name} is a remote model: stop_token_ids are a local "
                                                      "tokenizer's; use stop strings")
        body: dict[str, Any] = {"model": self.table.model, "stream": True, "stream_options": {"include_usage": True}}
        for name in _FORWARDED_PARAMS:
            if name in raw and raw[name] is not None:
                body[name] = raw[name]
        # A max_tokens at least the context limit (the HTTP APIs' "until the context is full") is the
        # server's to decide: it knows the model's context and counts the prompt, this daemon does
        # neither (so a context_limit, Ollama's num_ctx, bounds a remote request no further).
        if context_limit is not None and body.get("max_tokens", context_limit) >= context_limit:
            body.pop("max_tokens", None)
        if sources[0] == "prompt":
            body["prompt"] = parse_prompt(content["prompt"])
            return "/completions", body
        body["messages"] = parse_messages(content["messages"])
        if tools is not None:
            body["tools"] = [dict(t) for t in tools.tools]
            body["tool_choice"] = tools.choice if tools.choice != "function" else {
                "type": "function", "function": {"name": tools.function}}
        return "/chat/completions", body

    def error_for_status(self, status: int, body: bytes) -> ProtocolError:
        """What an HTTP error answer from the server means here (the error table in the README)."""
        detail = self.scrub(_error_message(body))
        where = f"the remote model {self.name} ({self.host})"
        if status in (401, 403):
            return ProtocolError(ErrorCode.REMOTE_ERROR, f"{where} refused the API key ({status}: {detail}); check "
                                                        "the key its api_key_env or api_key_file gives")
        if status == 404:
            return ProtocolError(ErrorCode.MODEL_NOT_FOUND, f"{where} answered 404 ({detail}); check its url and "
                                                           f"that the server serves {self.table.model!r}")
        if status == 413:
            return ProtocolError(ErrorCode.TOO_LONG, f"{where} refused the request as too large (413: {detail})")
        if status == 429:
            return ProtocolError(ErrorCode.OVERLOADED, f"{where} is overloaded (429: {detail}); try again later")
        if 400 <= status < 500:
            return ProtocolError(ErrorCode.BAD_REQUEST, f"{where} refused the request ({status}: {detail})")
        return ProtocolError(ErrorCode.REMOTE_ERROR, f"{where} failed ({status}: {detail})")


@dataclass(slots=True)
class RemoteHealth:
    """The remote as its last exchange (a request or a probe of ``/models``) left it."""

    state: str = "unknown"  # "ok", "failing" or "unknown" (nothing exchanged yet)
    detail: str | None = None  # why it is failing, or that the server does not list the model
    latency_s: float | None = None  # the last probe's round trip, or a request's time to its answer's headers
    checked_at: float = field(default_factory=time.time)

    def ok(self, latency_s: float | None = None, detail: str | None = None) -> None:
        self.state, self.detail, self.checked_at = "ok", detail, time.time()
        if latency_s is not None:
            self.latency_s = latency_s

    def failing(self, detail: str) -> None:
        self.state, self.detail, self.checked_at = "failing", detail, time.time()


@dataclass(slots=True)
class StreamReader:
    """One streamed answer's chunks (OpenAI's SSE ``data:`` payloads), read into text, tool calls, the
    finish reason and the usage. NOTE: the server is trusted to be the one configured, not to be
    well-formed: anything malformed is a ``remote_error``, never an exception elsewhere."""

    chat: bool
    max_bytes: int = MAX_ANSWER_BYTES  # text and tool calls' arguments, in all
    finish_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    _calls: dict[int, dict[str, str]] = field(default_factory=dict)
    _bytes: int = 0

    def feed(self, data: str) -> str:
        """A ``data:`` payload (not ``[DONE]``); returns its new text.

        Raises:
            ProtocolError: ``remote_error``: not a chunk, or an error the server sent mid-stream.
        """
        try:
            chunk = json.loads(data)
        except ValueError:
            raise _broken("a chunk that is not JSON") from None
        if not isinstance(chunk, dict):
            raise _broken("a chunk that is not an object")
        if "error" in chunk:
            raise ProtocolError(ErrorCode.REMOTE_ERROR, f"the remote server failed mid-answer: "
                                                       f"{_error_message(json.dumps(chunk).encode())}")
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            cached = usage.get("prompt_tokens_details")
            self.usage = {"prompt_tokens": _count(usage.get("prompt_tokens")),
                          "completion_tokens": _count(usage.get("completion_tokens")),
                          "cached_tokens": _count(cached.get("cached_tokens") if isinstance(cached, dict) else 0)}
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise _broken("a chunk without choices")
        text = ""
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # (one choice asked for)
            reason = choice.get("finish_reason")
            if isinstance(reason, str):  # (another server's own reasons, content_filter say, end it as a stop)
                self.finish_reason = reason if reason in FINISH_REASONS else "stop"
            if not self.chat:
                text += _str(choice.get("text"))
                continue
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            text += _str(delta.get("content"))
            calls = delta.get("tool_calls")
            if isinstance(calls, list):
                for call in calls:
                    self._add_call(call)
        self._spend(len(text))
        return text

    def _spend(self, n: int) -> None:
        self._bytes += n
        if self._bytes > self.max_bytes:
            raise ProtocolError(ErrorCode.REMOTE_ERROR, f"the remote server's answer passed {self.max_bytes >> 20} MiB "
                                                       "(a runaway stream: it was closed)")

    def tool_calls(self) -> list[dict[str, str]]:
        """The calls streamed, whole: ``[{"id", "name", "arguments"}]`` as llmd's ``done`` carries them."""
        calls = [self._calls[i] for i in sorted(self._calls)]
        for call in calls:
            call["id"] = call["id"] or new_call_id()
        return calls

    def _add_call(self, call: Any) -> None:
        if not isinstance(call, dict) or not isinstance(call.get("index", 0), int):
            raise _broken("a malformed tool call")
        index = call.get("index", 0)
        if index not in self._calls:
            if len(self._calls) >= MAX_TOOL_CALLS:
                raise _broken(f"more than {MAX_TOOL_CALLS} tool calls")
            self._calls[index] = {"id": "", "name": "", "arguments": ""}
        entry, fn = self._calls[index], call.get("function")
        entry["id"] = _str(call.get("id")) or entry["id"]
        if isinstance(fn, dict):
            name, arguments = _str(fn.get("name")), _str(fn.get("arguments"))
            self._spend(len(name) + len(arguments))
            entry["name"] += name
            entry["arguments"] += arguments


def _broken(what: str) -> ProtocolError:
    return ProtocolError(ErrorCode.REMOTE_ERROR, f"the remote server sent {what}: is its url an OpenAI-compatible "
                                                 "API (vLLM, SGLang: .../v1)?")


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _error_message(body: bytes) -> str:
    """The message of an error answer: OpenAI's ``{"error": {"message"}}`` (or ``{"error": str}``,
    ``{"detail"}``, ``{"message"}``), else its first line of text; at most 300 characters."""
    text = body[:MAX_ERROR_BODY_BYTES].decode("utf-8", "replace")
    message: Any = None
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        message = message or parsed.get("detail") or parsed.get("message")
    if not isinstance(message, str) or not message.strip():
        message = text.strip().splitlines()[0] if text.strip() else "no message"
    message = " ".join(message.split())
    return message[:300] + ("..." if len(message) > 300 else "")
