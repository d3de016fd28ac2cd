"""Requests into the daemon: a ``generate`` checked field by field, its prompt encoded on a worker
thread (daemon/prompt_encoder.py: nothing a client sends can stall the loop), and handed to its
model's engine when its tokens are ready; ``tokenize`` answered the same way. A request for a model
the daemon has not built yet waits for it (daemon/model_set.py), then starts the same way. A request
for a remote model (daemon/remote_model.py) is checked the same way and sent to its server at once."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field, fields
from typing import Any

from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.engine.sequence import check_priority
from llmd.daemon.model_set import MAX_MODEL_NAME_CHARS, ModelSet
from llmd.daemon.remote_model import RemoteModel
from llmd.daemon.remote_runner import RemoteRequest, RemoteRunner
from llmd.daemon.request_metrics import RequestMetrics
from llmd.daemon.served_model import ServedModel
from llmd.daemon.tool_calls import ToolCallParser, ToolRequest
from llmd.daemon.transport import Reply
from llmd.errors import LlmdError, PromptTooLongError, RequestError
from llmd.protocol import ErrorCode, Message, ProtocolError, parse_context_limit, require_str

log = logging.getLogger("llmd.server")

_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}
FRESH_ENCODING_WAIT_S = 0.02  # how long a loop turn waits for the prompts that arrived in it


@dataclass(slots=True)
class LiveRequest:
    """A request in flight, as the daemon sees it."""

    identity: bytes
    request_id: str
    parent: str
    stream: bool
    num_prompt_tokens: int
    public_id: str  # how the stats stream names it (request ids are private to their client)
    params: SamplingParams
    model: ServedModel | None  # None while the model it names is being built, and for a remote model's
    model_name: str
    priority: int = 0
    context_limit: int | None = None  # prompt + output at most this many tokens: max_tokens lowered to fit
    encoding: Future[list[int]] | None = None  # set until the prompt's tokens are ready
    grammar: Future[Any] | None = None  # its response format's matcher, compiling on a worker
    tools: ToolRequest | None = None
    tool_parser: ToolCallParser | None = None  # set when it is queued: its output into text and tool calls
    content: dict[str, Any] | None = None  # the request as sent, kept while it waits for its model
    remote: RemoteRequest | None = None  # a remote model's request (daemon/remote_runner.py): no engine
    text: list[str] = field(default_factory=list)  # collected for stream=False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)


def _fit_context(live: LiveRequest, ids: list[int], max_request_tokens: int) -> None:
    """A request with a ``context_limit`` asks for as many tokens as fit after its prompt, up to its
    max_tokens (the HTTP APIs' default: generate until the context is full)."""
    if live.context_limit is None:
        return
    limit = min(live.context_limit, max_request_tokens)
    if len(ids) >= limit:
        raise PromptTooLongError(f"the prompt is {len(ids)} tokens; this request's context holds {limit} "
                                 "(prompt and output): shorten the prompt")
    live.params.max_tokens = min(live.params.max_tokens, limit - len(ids))


class _NoRemotes:
    """The runner of a daemon without remote models: it has none to send to."""

    remotes: list[RemoteModel] = []

    def start(self, request: RemoteRequest) -> None:
        raise RuntimeError(f"no remote models here: {request.remote.name} cannot be sent")


def request_key(identity: bytes, request_id: str) -> str:
    """The engine's id of a client's request. NOTE: keyed by the client's identity too, so nobody
    can reach another's request."""
    return f"{identity.hex()}/{request_id}"


class Intake:
    """Args:
        models: the daemon's models; a request goes to the one it names (the default if none).
        live: the daemon's requests in flight, by :func:`request_key` (shared with the server).
        max_queue_len: waiting requests (queued, encoding or waiting for their model) beyond which
            new ones are refused.
        reply: queues a reply to a client.
        wake: called from the worker thread when an encoding finishes (wakes the loop).
        new_public_id: names a client's new request in the stats stream.
        metrics: counts the requests refused once their prompt is encoded.
        remote_runner: sends the requests for remote models (its ``remotes``); None: there are none.
    """

    def __init__(self, models: ModelSet, live: dict[str, LiveRequest], max_queue_len: int,
                 reply: Callable[[bytes, Reply], None], wake: Callable[[Future[list[int]]], None],
                 new_public_id: Callable[[bytes], str], metrics: RequestMetrics | None = None,
                 remote_runner: RemoteRunner | None = None) -> None:
        self.models, self.live, self.max_queue_len = models, live, max_queue_len
        self._runner: RemoteRunner | _NoRemotes = remote_runner or _NoRemotes()
        self._remotes = {r.name.casefold(): r for r in self._runner.remotes}
        self.metrics = metrics or RequestMetrics()
        self._reply, self._wake, self._new_public_id = reply, wake, new_public_id
        # `tokenize` and `detokenize` requests: (future, client, parent, reply type, the reply's field)
        self._encoding_replies: list[tuple[Future[Any], bytes, str, str, str]] = []
        self._fresh: list[Future[list[int]]] = []  # encodings started in this loop turn

    def generate(self, identity: bytes, msg: Message, stopping: bool = False) -> LiveRequest:
        """Check a ``generate`` and start encoding its prompt; :meth:`collect` queues it.

        Raises:
            ProtocolError: a field is bad, the id is in use, the daemon is ``stopping`` or the
                queue is full.
        """
        c = msg.content
        rid = require_str(c, "request_id")
        key = request_key(identity, rid)
        if key in self.live:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"request id {rid!r} is already in use")
        if stopping:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down; no new requests")
        queued = sum(m.engine.num_waiting for m in self.models.models.values()) + sum(
            1 for live in self.live.values() if live.encoding or (live.model is None and live.remote is None))
        if queued >= self.max_queue_len:
            raise ProtocolError(ErrorCode.OVERLOADED, f"{queued} requests are queued; try again later")
        stream = c.get("stream", True)
        if not isinstance(stream, bool):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "stream must be true or false")
        priority = c.get("priority", 0)
        context_limit = parse_context_limit(c.get("context_limit"))
        raw_params = c.get("params", {})
        if not isinstance(raw_params, dict) or set(raw_params) - _PARAM_FIELDS:
            unknown = sorted(set(raw_params) - _PARAM_FIELDS) if isinstance(raw_params, dict) else raw_params
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"params must be a map of sampling parameters; "
                                                      f"unknown: {unknown!r}")
        name = self.model_name(c)
        remote = self.remote_model(name)
        model = self.models.get(name) if remote is None else None
        try:
            check_priority(priority)
            # what the request leaves out: its model's defaults (applied again once a model being built is ready)
            params = SamplingParams(**((model.sampling_defaults if model else {}) | raw_params))
            tools = ToolRequest.parse(c.get("tools"), c.get("tool_choice"))
        except (RequestError, TypeError) as e:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(e)) from None
        if tools is not None:
            if "messages" not in c:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "tools go with messages (the chat template renders "
                                                          "them), not with a prompt or token ids")
            if params.response_format is not None and tools.choice != "none":
                raise ProtocolError(ErrorCode.BAD_REQUEST, "response_format and tools both shape the answer, and "
                                                          "the format leaves no room for a call; send one of them "
                                                          '(or tool_choice "none")')
            if tools.forced and remote is None:  # (a remote's server constrains its own output)
                params.response_format = tools.response_format()
        if remote is not None:
            return self._start_remote(identity, msg, remote, stream, priority, context_limit, params, tools)
        if model is None:
            try:
                self.models.check(name)
            except LlmdError as e:
                raise ProtocolError(ErrorCode.MODEL_NOT_FOUND, str(e)) from None
            self.models.want(name)
        live = LiveRequest(identity, rid, msg.msg_id, stream, 0, self._new_public_id(identity), params, model,
                           self.models.key(name), priority, context_limit, tools=tools)
        if model is None:
            live.content = c  # encoded once the model is built (start_waiting)
        else:
            self._start(live, c)
        self.live[key] = live
        return live

    def remote_model(self, name: str | None) -> RemoteModel | None:
        """The remote model ``name`` names (any case), if it names one."""
        return self._remotes.get(name.casefold()) if name else None

    def _start_remote(self, identity: bytes, msg: Message, remote: RemoteModel, stream: bool, priority: int,
                      context_limit: int | None, params: SamplingParams, tools: ToolRequest | None) -> LiveRequest:
        """Send a request for a remote model to its server (``accepted`` once the server answers)."""
        in_flight = sum(1 for live in self.live.values() if live.remote is not None)
        if in_flight >= self.max_queue_len:  # (a bound on the connections a local client can make us hold)
            raise ProtocolError(ErrorCode.OVERLOADED, f"{in_flight} requests to remote models are in flight; try "
                                                     "again later")
        rid = msg.content["request_id"]
        path, body = remote.upstream_request(msg.content, params, tools, context_limit)
        key = request_key(identity, rid)
        request = RemoteRequest(key, remote, path, body)
        live = LiveRequest(identity, rid, msg.msg_id, stream, 0, self._new_public_id(identity), params, None,
                           remote.name, priority, context_limit, tools=tools, remote=request)
        self.live[key] = live
        self._runner.start(request)  # (a remote model is found only through the runner: it exists)
        return live

    def model_name(self, content: dict[str, Any]) -> str | None:
        """The ``model`` a message names (None: the default).

        Raises:
            ProtocolError: not a string of at most MAX_MODEL_NAME_CHARS characters.
        """
        name = content.get("model")
        if name is not None and (not isinstance(name, str) or len(name) > MAX_MODEL_NAME_CHARS):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"model must be a name of at most {MAX_MODEL_NAME_CHARS} "
                                                      "characters (a name from `llmd models`), or absent")
        return name or None

    def start_waiting(self, model: ServedModel) -> None:
        """The requests that waited for ``model`` to be built: their defaults applied, encoding."""
        for live in self.live.values():
            if live.model is None and live.remote is None and live.model_name == model.name and \
                    live.content is not None:
                content, live.content, live.model = live.content, None, model
                raw = content.get("params") or {}
                params = SamplingParams(**(model.sampling_defaults | raw))  # (checked once already)
                params.response_format = live.params.response_format  # (a forced tool call's, too)
                live.params = params
                self._start(live, content)

    def fail_waiting(self, name: str, code: str, message: str) -> None:
        """The requests that waited for ``name``, which could not be built."""
        for key, live in list(self.live.items()):
            if live.model is None and live.remote is None and live.model_name == name:
                self._refuse(key, code, message)

    def _start(self, live: LiveRequest, content: dict[str, Any]) -> None:
        """Encode its prompt and compile its response format, on workers."""
        model = live.model
        live.encoding = model.encoder.submit(content, None if live.tools is None else live.tools.template_tools())
        live.encoding.add_done_callback(self._wake)
        self._fresh.append(live.encoding)
        if live.params.response_format is not None:  # a large schema compiles for long: never on this thread
            live.grammar = model.engine.grammar_compiler.submit(live.params.response_format)
            live.grammar.add_done_callback(self._wake)
            self._fresh.append(live.grammar)

    def tokenize(self, identity: bytes, msg: Message) -> None:
        """Start encoding a ``tokenize``'s prompt; :meth:`collect` answers it."""
        encoder = self._built(msg.content).encoder
        self._encode_for_reply(encoder.submit(msg.content), identity, msg.msg_id, "tokens", "token_ids")

    def detokenize(self, identity: bytes, msg: Message) -> None:
        """Start decoding a ``detokenize``'s ids; :meth:`collect` answers it."""
        encoder = self._built(msg.content).encoder
        self._encode_for_reply(encoder.submit_pieces(msg.content), identity, msg.msg_id, "pieces", "pieces")

    def _built(self, content: dict[str, Any]) -> ServedModel:
        """The model a ``tokenize`` or ``detokenize`` names, which must be built already (its tokenizer).

        Raises:
            ProtocolError: ``model_not_found``.
        """
        name = self.model_name(content)
        if self.remote_model(name) is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} is a remote model: its tokenizer is its server's "
                                                      "(ask the server's own /tokenize, if it has one)")
        model = self.models.get(name)
        if model is None:
            raise ProtocolError(ErrorCode.MODEL_NOT_FOUND, f"model {name!r} is not loaded here: a generate request "
                                                          "naming it loads it")
        return model

    def _encode_for_reply(self, future: Future[Any], identity: bytes, parent: str, reply_type: str,
                          field_name: str) -> None:
        future.add_done_callback(self._wake)
        self._encoding_replies.append((future, identity, parent, reply_type, field_name))

    def collect(self) -> None:
        """Queue the requests whose prompts are encoded (``accepted``, or their error); answer
        the ``tokenize`` requests that are done. Called once a loop turn, after the pipe the wake
        callback writes to had something in it."""
        for key, live in list(self.live.items()):
            if live.encoding is None or not live.encoding.done() or (live.grammar and not live.grammar.done()):
                continue
            future, live.encoding = live.encoding, None
            engine = live.model.engine
            try:
                ids = future.result()
                _fit_context(live, ids, engine.max_request_tokens)
                grammar = None if live.grammar is None else live.grammar.result()
                live.grammar = None
                if live.tools is not None:
                    live.tool_parser = ToolCallParser(live.tools, live.model.encoder.tool_style)
                engine.add_request(key, ids, live.params, owner=live.identity, priority=live.priority, grammar=grammar)
            except ProtocolError as e:
                self._refuse(key, e.code, str(e))
                continue
            except PromptTooLongError as e:
                self._refuse(key, ErrorCode.TOO_LONG, str(e))
                continue
            except (RequestError, TypeError) as e:
                self._refuse(key, ErrorCode.BAD_REQUEST, str(e))
                continue
            except Exception as e:  # a bug must cost one request, never the daemon
                log.exception("failed to queue a request")
                self._refuse(key, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
                continue
            live.num_prompt_tokens = len(ids)
            self._reply(live.identity, ("accepted", {"request_id": live.request_id, "prompt_tokens": len(ids),
                                                     "id": live.public_id}, live.parent))
        pending = []
        for future, identity, parent, reply_type, field_name in self._encoding_replies:
            if not future.done():
                pending.append((future, identity, parent, reply_type, field_name))
                continue
            try:
                self._reply(identity, (reply_type, {field_name: future.result()}, parent))
            except ProtocolError as e:
                self._reply(identity, ("error", {"code": e.code, "message": str(e)}, parent))
            except Exception as e:
                log.exception("failed to %s", "tokenize" if reply_type == "tokens" else "detokenize")
                self._reply(identity, ("error", {"code": ErrorCode.INTERNAL, "message": f"{type(e).__name__}: {e}"},
                                       parent))
        self._encoding_replies = pending

    def wait_for_fresh(self) -> None:
        """Give the prompts that arrived in this loop turn a moment to encode. NOTE: a usual prompt
        encodes in a millisecond: worth waiting that long for it, since otherwise it misses the
        next step, which may take a second on a CPU."""
        if self._fresh:
            wait(self._fresh, timeout=FRESH_ENCODING_WAIT_S)
            self._fresh.clear()

    def _refuse(self, key: str, code: str, message: str) -> None:
        self.metrics.refuse(code)
        live = self.live.pop(key)
        self._reply(live.identity, ("error", {"code": code, "message": message, "request_id": live.request_id},
                                    live.parent))
