"""Client library for the llmd daemon: :class:`Client` (blocking) and :class:`AsyncClient` (asyncio).

Both find the daemon through the connection file in the runtime dir, sign every message with its
key, and speak the protocol in ``llmd.protocol`` (documented in docs/protocol.md)::

    from llmd import Client
    with Client() as c:
        for delta in c.chat([{"role": "user", "content": "Hi!"}], max_tokens=64):
            print(delta.text, end="", flush=True)
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from llmd.config import runtime_dir
from llmd.errors import LlmdError
from llmd.paths import process_alive, read_connection_file
from llmd.protocol import MAX_MESSAGE_BYTES, REPLY_TYPES, Message, ProtocolError, decode, encode, new_msg_id

SILENCE_TIMEOUT_S = 15.0  # the daemon writes at least every second while a request is in flight
# How often a waiting client checks that the daemon still exists: a dead daemon is noticed this
# fast (its process gone, or the connection to it closed), a hung one only after the silence timeout.
LIVENESS_CHECK_S = 0.25


class DaemonNotRunningError(LlmdError):
    """No daemon answers at the connection file, or it died or stopped answering."""


class MessageTooLargeError(LlmdError):
    """A request too large for the wire (over 4 MiB in one frame); refused before sending, so the
    connection and the client's other requests live on."""


class ServerError(LlmdError):
    """The daemon refused or failed a request; ``code`` is a protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} ({code})")
        self.code = code
        self.message = message


@dataclass(slots=True)
class Delta:
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[Any] | None = None


@dataclass(slots=True)
class Result:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    # with params prompt_logprobs: per prompt token, None (the first) or [logprob, [[token, logprob], ...]]
    prompt_logprobs: list[Any] | None = None
    # with params logprobs and stream=False: per output token, [logprob, [[token, logprob], ...]]
    # (a stream carries them in its deltas instead)
    logprobs: list[Any] | None = None
    # with tools: the calls the model made, [{"id", "name", "arguments": JSON text}] (finish_reason "tool_calls")
    tool_calls: list[dict[str, str]] | None = None


def load_connection(socket_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The running daemon's connection info.

    Raises:
        DaemonNotRunningError: no connection file, or its daemon process is gone.
    """
    info = read_connection_file(runtime_dir(socket_dir, create=False))
    if info is None:
        raise DaemonNotRunningError("no llmd daemon is running; start one with `llmd start`")
    return info


def _connect(sock: zmq.Socket, connection: dict[str, Any], endpoint: str) -> None:
    """Connect to one of the daemon's endpoints; TCP ones need the CURVE keys of the connection file."""
    address = connection[endpoint]
    if address.startswith("tcp://"):
        try:
            sock.setsockopt(zmq.CURVE_SERVERKEY, connection["curve_server_key"].encode())
            sock.setsockopt(zmq.CURVE_PUBLICKEY, connection["curve_public_key"].encode())
            sock.setsockopt(zmq.CURVE_SECRETKEY, connection["curve_secret_key"].encode())
        except (KeyError, AttributeError, zmq.ZMQError):
            raise LlmdError("the connection file lacks valid CURVE keys for its TCP endpoint; copy the whole "
                            "daemon.json of the running daemon") from None
    sock.connect(address)


class _Liveness:
    """Tells a waiting client that its daemon is gone, within about LIVENESS_CHECK_S: the connection
    closed after the awaited message was sent (the daemon died, or dropped this client), or, for a
    local daemon, its process no longer exists."""

    def __init__(self, sock: zmq.Socket, connection: dict[str, Any], endpoint: str) -> None:
        self.connection = connection
        # NOTE: the pid means something only on the daemon's machine: an ipc endpoint is there; a
        # TCP one (the connection file copied elsewhere) may not be.
        self._local = str(connection.get(endpoint, "")).startswith("ipc://")
        self._sock = sock
        # NOTE: a blocking monitor socket even for an asyncio ``sock``: it is only polled, never awaited.
        address = f"inproc://llmd-monitor-{os.urandom(8).hex()}"
        sock.monitor(address, zmq.EVENT_DISCONNECTED)
        self._monitor = zmq.Context(shadow=sock.context.underlying).socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(address)
        self._closings = 0  # connection closings seen so far
        self._sent_at: dict[str, int] = {}  # route key -> closings seen when its message was sent

    def sent(self, key: str) -> None:
        self._refresh()
        self._sent_at.setdefault(key, self._closings)

    def ended(self, key: str) -> None:
        self._sent_at.pop(key, None)

    def why_gone(self, key: str) -> str | None:
        self._refresh()
        if self._closings > self._sent_at.get(key, self._closings):
            return ("the connection to the llmd daemon closed (it stopped, or dropped this client); "
                    "this request is lost")
        pid = self.connection.get("pid")
        if self._local and isinstance(pid, int) and not process_alive(pid):
            return f"the llmd daemon (pid {pid}) has exited; start it again with `llmd start`"
        return None

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(0)

    def _refresh(self) -> None:
        while self._monitor.poll(0):
            self._monitor.recv_multipart()
            self._closings += 1


def _listened(polled_at: float) -> float:
    """How long a poll begun at ``polled_at`` listened: its own length, at most twice what it asked
    for. Time this client was itself stopped (SIGSTOP, a suspended laptop) is not the daemon's
    silence: after a resume the waiting replies must be read, not declared missing."""
    return min(time.monotonic() - polled_at, 2 * LIVENESS_CHECK_S)


def _silence_message(timeout: float, connection: dict[str, Any]) -> str:
    pid = connection.get("pid")
    hint = f" (pid {pid} exists but does not answer; `llmd stop --force` ends it)" if isinstance(pid, int) else ""
    return f"the llmd daemon did not answer for {timeout:.0f}s{hint}"


def _encode_checked(key: bytes, msg_type: str, content: dict[str, Any], msg_id: str) -> list[bytes]:
    frames = encode(key, msg_type, content, msg_id=msg_id)
    size = max(len(f) for f in frames)
    if size > MAX_MESSAGE_BYTES:
        raise MessageTooLargeError(f"this {msg_type} request is {size / 2**20:.1f} MiB, over the "
                                   f"{MAX_MESSAGE_BYTES // 2**20} MiB a message can carry; send a shorter prompt")
    return frames


def _route_key(msg: Message) -> str:
    rid = msg.content.get("request_id")
    return f"req:{rid}" if isinstance(rid, str) else f"msg:{msg.parent}"


def _accept(key: bytes, frames: list[bytes], discard: set[str]) -> tuple[str, Message] | None:
    """Decode a reply and pick its queue; None for keepalives, forgeries and the leftovers of
    requests cancelled without waiting (whose key is dropped from ``discard`` at their end)."""
    try:
        msg = decode(key, frames, REPLY_TYPES)
    except ProtocolError:
        return None  # not from our daemon
    if msg.type == "keepalive":
        return None
    route = _route_key(msg)
    if route in discard:
        if msg.type in ("done", "error"):
            discard.discard(route)
        return None
    return route, msg


def _generate_content(request_id: str, prompt: str | None, messages: list[dict[str, Any]] | None,
                      token_ids: list[int] | None, stream: bool, params: dict[str, Any], priority: int = 0,
                      context_limit: int | None = None, tools: list[dict[str, Any]] | None = None,
                      tool_choice: str | dict[str, Any] | None = None, model: str | None = None) -> dict[str, Any]:
    given = [x is not None for x in (prompt, messages, token_ids)]
    if sum(given) != 1:
        raise ValueError("pass exactly one of prompt, messages, token_ids")
    content: dict[str, Any] = {"request_id": request_id, "stream": stream, "params": params}
    if model is not None:
        content["model"] = model
    if priority:
        content["priority"] = priority
    if context_limit is not None:
        content["context_limit"] = context_limit
    if tools is not None:
        content["tools"] = tools
    if tool_choice is not None:
        content["tool_choice"] = tool_choice
    if prompt is not None:
        content["prompt"] = prompt
    elif messages is not None:
        content["messages"] = messages
    else:
        content["token_ids"] = list(token_ids or [])
    return content


def _tokenize_content(prompt: str | None, messages: list[dict[str, str]] | None, model: str | None = None
                      ) -> dict[str, Any]:
    content: dict[str, Any] = {"prompt": prompt} if messages is None else {"messages": messages}
    return content if model is None else {**content, "model": model}


def _model_content(model: str | None) -> dict[str, Any] | None:
    return None if model is None else {"model": model}


def _stats_socket(ctx: zmq.Context, connection: dict[str, Any], endpoint: str) -> zmq.Socket:
    # A small receive queue: stats are replaceable, a slow reader should see the newest.
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"stats")
    sub.setsockopt(zmq.RCVHWM, 4)
    _connect(sub, connection, "tcp_stats" if endpoint == "tcp_requests" else "stats")
    return sub


def _stats_content(key: bytes, frames: list[bytes]) -> dict[str, Any] | None:
    """A published stats message (frames after the topic), or None if it is not our daemon's."""
    try:
        return decode(key, frames[1:], ("stats",)).content
    except ProtocolError:
        return None


def _check(msg: Message) -> Message:
    if msg.type == "error":
        raise ServerError(str(msg.content.get("code")), str(msg.content.get("message")))
    return msg


def _result(request_id: str, done: dict[str, Any], text: str = "", token_ids: list[int] | None = None) -> Result:
    return Result(request_id, done.get("text", text), done.get("token_ids", token_ids or []),
                  done.get("finish_reason"), done.get("usage", {}), done.get("timings", {}),
                  done.get("prompt_logprobs"), done.get("logprobs"), done.get("tool_calls"))


class Stream:
    """Iterator over one request's deltas; afterwards ``result`` holds the finish reason, usage and
    timings. Breaking out early cancels the request."""

    def __init__(self, client: Client, request_id: str) -> None:
        self.client = client
        self.request_id = request_id
        self.result: Result | None = None
        self._text: list[str] = []
        self._tokens: list[int] = []

    def __iter__(self) -> Iterator[Delta]:
        try:
            while self.result is None:
                msg = _check(self.client._wait(f"req:{self.request_id}"))
                if msg.type == "delta":
                    d = Delta(self.request_id, msg.content.get("text", ""), msg.content.get("token_ids", []),
                              msg.content.get("logprobs"))
                    self._text.append(d.text)
                    self._tokens.extend(d.token_ids)
                    yield d
                elif msg.type == "done":
                    self.result = _result(self.request_id, msg.content, "".join(self._text), self._tokens)
        finally:
            if self.result is None and not self.client.socket.closed:
                self.client.cancel(self.request_id, wait=False)


class _ClientCore:
    """What :class:`Client` and :class:`AsyncClient` share, all but the waiting: the connection,
    the DEALER socket (from the sync or asyncio ``ctx``), liveness, request ids, signing, and the
    requests cancelled without waiting whose leftovers are dropped (``_discard``)."""

    def __init__(self, socket_dir: str | os.PathLike[str] | None, connection: dict[str, Any] | None,
                 endpoint: str, ctx: zmq.Context) -> None:
        self.connection = connection or load_connection(socket_dir)
        self.key = bytes.fromhex(self.connection["key"])
        self.endpoint = endpoint
        self.ctx = ctx
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self._liveness = _Liveness(self.socket, self.connection, endpoint)
        try:
            _connect(self.socket, self.connection, endpoint)
        except LlmdError:
            self._close_socket()
            raise
        self._discard: set[str] = set()  # route keys of requests we cancelled without waiting
        self._ids = itertools.count()
        self._prefix = os.urandom(3).hex()

    def _close_socket(self) -> None:
        self._liveness.close()
        self.socket.close(0)

    def _new_request_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def _frames(self, msg_type: str, content: dict[str, Any]) -> tuple[list[bytes], str]:
        """A request's signed frames and its message id; what answers it is now awaited."""
        msg_id = new_msg_id()
        frames = _encode_checked(self.key, msg_type, content, msg_id)
        rid = content.get("request_id")
        self._liveness.sent(f"req:{rid}" if isinstance(rid, str) else f"msg:{msg_id}")
        return frames, msg_id

    def _ended(self, key: str, msg: Message) -> None:
        """``msg`` came for ``key``: a reply to a message, or a request's last, ends the wait on it."""
        if key.startswith("msg:") or msg.type in ("done", "error"):
            self._liveness.ended(key)

    def _abandon(self, request_id: str) -> None:
        """Stop waiting for a request cancelled without waiting: its last messages are dropped."""
        self._liveness.ended(f"req:{request_id}")
        self._discard.add(f"req:{request_id}")

    def _silence(self, key: str, silent: float, timeout: float) -> None:
        """After a quiet poll of ``key``: raise if the daemon is gone, or has been silent too long."""
        if (why := self._liveness.why_gone(key)) is not None:
            self._liveness.ended(key)
            raise DaemonNotRunningError(why)
        if silent > timeout:
            raise DaemonNotRunningError(_silence_message(timeout, self.connection))


class Client(_ClientCore):
    """Blocking client. Not thread-safe: use one per thread.

    Args:
        socket_dir: the daemon's runtime dir (default: as ``llmd start`` picks it).
        connection: connection info to use instead of reading the file (tests, TCP).
        endpoint: ``requests`` (ipc) or ``tcp_requests``.
    """

    def __init__(self, socket_dir: str | os.PathLike[str] | None = None, *,
                 connection: dict[str, Any] | None = None, endpoint: str = "requests") -> None:
        super().__init__(socket_dir, connection, endpoint, zmq.Context.instance())
        self._pending: dict[str, deque[Message]] = {}

    def close(self) -> None:
        self._close_socket()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _send(self, msg_type: str, content: dict[str, Any]) -> str:
        frames, msg_id = self._frames(msg_type, content)
        self.socket.send_multipart(frames)
        return msg_id

    def _wait(self, key: str, timeout: float = SILENCE_TIMEOUT_S) -> Message:
        """The next message routed to ``key``, stashing the others.

        Raises:
            DaemonNotRunningError: the daemon died or dropped the connection (noticed within about
                LIVENESS_CHECK_S), or said nothing at all for ``timeout`` s.
        """
        silent = 0.0  # how long this wait has listened without hearing anything
        while True:
            box = self._pending.get(key)
            if box:
                msg = box.popleft()
                if not box:
                    del self._pending[key]  # no key outlives its messages
                self._ended(key, msg)
                return msg
            polled_at = time.monotonic()
            if not self.socket.poll(int(LIVENESS_CHECK_S * 1000)):
                silent += _listened(polled_at)
                self._silence(key, silent, timeout)
                continue
            silent = 0.0
            routed = _accept(self.key, self.socket.recv_multipart(), self._discard)
            if routed is not None:
                self._pending.setdefault(routed[0], deque()).append(routed[1])

    def _call(self, msg_type: str, content: dict[str, Any] | None = None, timeout: float = SILENCE_TIMEOUT_S
              ) -> dict[str, Any]:
        msg_id = self._send(msg_type, content or {})
        return _check(self._wait(f"msg:{msg_id}", timeout)).content

    def health(self, timeout: float = 5.0) -> dict[str, Any]:
        return self._call("health", timeout=timeout)

    def info(self, model: str | None = None) -> dict[str, Any]:
        """The daemon and its default model; with ``model``, that (loaded) model's fields instead."""
        return self._call("info", _model_content(model))

    def stats(self) -> dict[str, Any]:
        return self._call("stats")

    def tokenize(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                 model: str | None = None) -> list[int]:
        return self._call("tokenize", _tokenize_content(prompt, messages, model))["token_ids"]

    def detokenize(self, token_ids: list[int], model: str | None = None) -> list[str]:
        """Each token's text on its own (at most 4096 ids a call), by ``model``'s tokenizer (the default's)."""
        return self._call("detokenize", {"token_ids": list(token_ids), **(_model_content(model) or {})})["pieces"]

    def shutdown(self, timeout: float = SILENCE_TIMEOUT_S) -> dict[str, Any]:
        return self._call("shutdown", timeout=timeout)

    def generate(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                 token_ids: list[int] | None = None, stream: bool = True, request_id: str | None = None,
                 priority: int = 0, context_limit: int | None = None, tools: list[dict[str, Any]] | None = None,
                 tool_choice: str | dict[str, Any] | None = None, model: str | None = None,
                 **params: Any) -> Stream | Result:
        """Start a request. ``params`` are sampling parameters (``max_tokens``, ``temperature``...);
        ``priority`` (-10..10, higher first) puts it ahead of this daemon's lower-priority work;
        ``context_limit`` caps prompt + output at that many tokens, lowering ``max_tokens`` to fit
        (so a large ``max_tokens`` means "until the context is full"); ``tools`` and ``tool_choice``
        (with ``messages``) are OpenAI's: the calls come in the result's ``tool_calls``; ``model``
        names the model to answer (a name from ``llmd models``; the daemon's default if None), which
        the daemon loads if it must.

        Returns:
            With ``stream`` a :class:`Stream` of :class:`Delta` (its ``result`` set at the end),
            else the :class:`Result`.

        Raises:
            ServerError: the daemon refused the request (bad_request, too_long, overloaded...).
        """
        rid = request_id or self._new_request_id()
        self._send("generate", _generate_content(rid, prompt, messages, token_ids, stream, params, priority,
                                                 context_limit, tools, tool_choice, model))
        _check(self._wait(f"req:{rid}"))  # accepted, or the refusal
        if stream:
            return Stream(self, rid)
        while True:
            msg = _check(self._wait(f"req:{rid}"))
            if msg.type == "done":
                return _result(rid, msg.content)

    def chat(self, messages: list[dict[str, str]], **kwargs: Any) -> Stream | Result:
        return self.generate(messages=messages, **kwargs)

    def cancel(self, request_id: str, wait: bool = True) -> None:
        """Cancel one of this client's requests. With ``wait``, returns once it has ended.

        Raises:
            ServerError: ``unknown_request`` if it is not running (finished, or never existed).
        """
        self._send("cancel", {"request_id": request_id})
        if wait:
            while True:
                msg = _check(self._wait(f"req:{request_id}"))
                if msg.type == "done":
                    return
        self._pending.pop(f"req:{request_id}", None)
        self._abandon(request_id)

    def subscribe_stats(self, timeout: float | None = SILENCE_TIMEOUT_S) -> Iterator[dict[str, Any]]:
        """Yield the daemon's stats as it publishes them (a few times a second); after ``timeout``
        seconds without any, raise DaemonNotRunningError (None: wait through any silence)."""
        sub = _stats_socket(self.ctx, self.connection, self.endpoint)
        try:
            while True:
                if not sub.poll(None if timeout is None else int(timeout * 1000)):
                    raise DaemonNotRunningError(_silence_message(timeout, self.connection))
                stats = _stats_content(self.key, sub.recv_multipart())
                if stats is not None:
                    yield stats
        finally:
            sub.close(0)


class AsyncClient(_ClientCore):
    """asyncio client with the calls of :class:`Client`, as awaitables and async iterators: the
    same arguments, errors and timeouts. ``generate`` with ``stream`` is an async iterator of
    :class:`Delta` ending with the :class:`Result`; without, an awaitable of the Result."""

    def __init__(self, socket_dir: str | os.PathLike[str] | None = None, *,
                 connection: dict[str, Any] | None = None, endpoint: str = "requests") -> None:
        super().__init__(socket_dir, connection, endpoint, zmq.asyncio.Context.instance())
        self._queues: dict[str, asyncio.Queue[Message]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._last_heard = time.monotonic()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._close_socket()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _queue(self, key: str) -> asyncio.Queue[Message]:
        return self._queues.setdefault(key, asyncio.Queue())

    async def _read_forever(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            self._last_heard = time.monotonic()
            routed = _accept(self.key, frames, self._discard)
            if routed is not None:
                self._queue(routed[0]).put_nowait(routed[1])

    async def _send(self, msg_type: str, content: dict[str, Any]) -> str:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_forever())
        frames, msg_id = self._frames(msg_type, content)
        await self.socket.send_multipart(frames)
        return msg_id

    async def _wait(self, key: str, timeout: float = SILENCE_TIMEOUT_S) -> Message:
        """As :meth:`Client._wait`."""
        queue = self._queue(key)
        silent = 0.0
        while True:
            polled_at = time.monotonic()
            try:
                msg = await asyncio.wait_for(queue.get(), timeout=LIVENESS_CHECK_S)
                self._ended(key, msg)
                return msg
            except asyncio.TimeoutError:
                silent = 0.0 if self._last_heard >= polled_at else silent + _listened(polled_at)
                self._silence(key, silent, timeout)

    async def _call(self, msg_type: str, content: dict[str, Any] | None = None, timeout: float = SILENCE_TIMEOUT_S
                    ) -> dict[str, Any]:
        msg_id = await self._send(msg_type, content or {})
        try:
            return _check(await self._wait(f"msg:{msg_id}", timeout)).content
        finally:
            self._queues.pop(f"msg:{msg_id}", None)

    async def health(self, timeout: float = 5.0) -> dict[str, Any]:
        return await self._call("health", timeout=timeout)

    async def info(self, model: str | None = None) -> dict[str, Any]:
        return await self._call("info", _model_content(model))

    async def stats(self) -> dict[str, Any]:
        return await self._call("stats")

    async def tokenize(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                       model: str | None = None) -> list[int]:
        return (await self._call("tokenize", _tokenize_content(prompt, messages, model)))["token_ids"]

    async def detokenize(self, token_ids: list[int], model: str | None = None) -> list[str]:
        content = {"token_ids": list(token_ids), **(_model_content(model) or {})}
        return (await self._call("detokenize", content))["pieces"]

    async def shutdown(self, timeout: float = SILENCE_TIMEOUT_S) -> dict[str, Any]:
        return await self._call("shutdown", timeout=timeout)

    def generate(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                 token_ids: list[int] | None = None, stream: bool = True, request_id: str | None = None,
                 on_accepted: Callable[[dict[str, Any]], None] | None = None, priority: int = 0,
                 context_limit: int | None = None, tools: list[dict[str, Any]] | None = None,
                 tool_choice: str | dict[str, Any] | None = None, model: str | None = None, **params: Any
                 ) -> AsyncIterator[Delta | Result] | Awaitable[Result]:
        """Start a request, as :meth:`Client.generate`. With ``stream``, an async iterator of
        :class:`Delta` ending with one :class:`Result`; leaving it early cancels the request
        (close the iterator, ``aclose()``, to cancel at once). Without, an awaitable of the Result.
        ``on_accepted`` gets the daemon's ``accepted`` reply (its ``id`` names the request in the
        published stats)."""
        rid = request_id or self._new_request_id()
        content = _generate_content(rid, prompt, messages, token_ids, stream, params, priority, context_limit,
                                    tools, tool_choice, model)
        if stream:
            return self._stream(rid, content, on_accepted)
        return self._complete(rid, content, on_accepted)

    async def _complete(self, rid: str, content: dict[str, Any],
                        on_accepted: Callable[[dict[str, Any]], None] | None) -> Result:
        async for item in self._stream(rid, content, on_accepted):
            if isinstance(item, Result):
                return item
        raise DaemonNotRunningError("the request ended without a result")  # unreachable: _stream yields one

    async def _stream(self, rid: str, content: dict[str, Any],
                      on_accepted: Callable[[dict[str, Any]], None] | None) -> AsyncIterator[Delta | Result]:
        await self._send("generate", content)
        key = f"req:{rid}"
        ended = False  # the daemon sent this request's done or error: nothing to cancel
        text: list[str] = []
        tokens: list[int] = []
        try:
            reply = await self._wait(key)
            ended = reply.type == "error"
            _check(reply)
            if on_accepted is not None:
                on_accepted(reply.content)
            while not ended:
                msg = await self._wait(key)
                ended = msg.type in ("done", "error")
                _check(msg)
                if msg.type == "delta":
                    d = Delta(rid, msg.content.get("text", ""), msg.content.get("token_ids", []),
                              msg.content.get("logprobs"))
                    text.append(d.text)
                    tokens.extend(d.token_ids)
                    yield d
                elif msg.type == "done":
                    yield _result(rid, msg.content, "".join(text), tokens)
        finally:
            # Left early, even before `accepted` arrived: cancel. The daemon reads one socket's
            # messages in order, so it has seen the generate; a refused one answers the cancel
            # with an error that lands in the discarded queue like the request's own leftovers.
            if not ended and not self.socket.closed:
                try:
                    await self.cancel(rid, wait=False)
                except zmq.ZMQError:
                    self._abandon(rid)  # the client is closing
            self._queues.pop(key, None)
            self._liveness.ended(key)

    def chat(self, messages: list[dict[str, str]], **kwargs: Any) -> AsyncIterator[Delta | Result] | Awaitable[Result]:
        return self.generate(messages=messages, **kwargs)

    async def cancel(self, request_id: str, wait: bool = True) -> None:
        """Cancel one of this client's requests, as :meth:`Client.cancel`: with ``wait``, returns
        once it has ended.

        Raises:
            ServerError: ``unknown_request`` if it is not running (finished, or never existed).
        """
        if not wait:
            self._abandon(request_id)  # before the send: its last messages may come at once
            self._queues.pop(f"req:{request_id}", None)
        await self._send("cancel", {"request_id": request_id})
        if wait:
            try:
                while _check(await self._wait(f"req:{request_id}")).type != "done":
                    pass
            finally:
                self._queues.pop(f"req:{request_id}", None)

    async def subscribe_stats(self, timeout: float | None = SILENCE_TIMEOUT_S) -> AsyncIterator[dict[str, Any]]:
        """As :meth:`Client.subscribe_stats`."""
        sub = _stats_socket(self.ctx, self.connection, self.endpoint)
        try:
            while True:
                if not await sub.poll(None if timeout is None else int(timeout * 1000)):
                    raise DaemonNotRunningError(_silence_message(timeout, self.connection))
                stats = _stats_content(self.key, await sub.recv_multipart())
                if stats is not None:
                    yield stats
        finally:
            sub.close(0)


__all__ = ["AsyncClient", "Client", "DaemonNotRunningError", "Delta", "MessageTooLargeError", "Result",
           "ServerError", "Stream", "load_connection"]
