"""The HTTP side of remote models (daemon/remote_model.py): one thread running an asyncio loop, one
``httpx.AsyncClient`` per remote, one task per request streaming its answer.

The daemon's loop never waits on a remote: :meth:`RemoteRunner.start` and :meth:`cancel` hand work
to the thread, and what comes back (the answer's headers, text, the end, or a typed error) waits
in a queue for :meth:`events`, the loop woken through ``wake``. A slow or dead remote costs its own
requests their time and nothing else. A cancel cancels the request's task, which closes its
connection: the remote server sees the client go, as it would see any of its own clients go.

Each remote is probed (``GET /models``) at start and every ``probe_interval_s`` so the dashboard
can show its health before the first request, and every request's outcome updates it too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmd.daemon.remote_model import MAX_ERROR_BODY_BYTES, RemoteModel, StreamReader
from llmd.protocol import ErrorCode, ProtocolError

if TYPE_CHECKING:
    import httpx

# NOTE: httpx (~0.1 s, with its CLI's click and rich) is imported where a remote is served, inside
# the runner's methods: a daemon without remotes, which never builds a runner, does not pay for it
# before its first answer.

log = logging.getLogger("llmd.server")

MAX_LINE_BYTES = 4 << 20  # one SSE line: a chunk of a few tokens is ~300 bytes
MAX_PROBE_BYTES = 1 << 20  # a /models answer
PROBE_INTERVAL_S = 30.0
MAX_CONNECTIONS = 256  # to one remote at once (the daemon takes at most max_queue_len remote requests)


@dataclass(eq=False, slots=True)
class RemoteRequest:
    """One request to a remote, as the daemon's loop sees it (its fields change on the loop only,
    as its events are taken)."""

    key: str  # the engine-style request key (daemon/intake.py's request_key)
    remote: RemoteModel
    path: str
    body: dict[str, Any]
    sent_at: float = field(default_factory=time.monotonic)
    first_text_at: float | None = None
    last_text_at: float | None = None
    num_chunks: int = 0  # chunks with text: the tokens so far, as far as this side can tell
    task: asyncio.Task[None] | None = None


@dataclass(slots=True)
class RemoteEvent:
    """What a remote request's task hands the loop: ``accepted`` (the server answered 200), ``text``,
    ``done`` (with the finish reason, usage and tool calls) or ``error`` (a typed one)."""

    request: RemoteRequest
    kind: str
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    tool_calls: list[dict[str, str]] = field(default_factory=list)
    at: float = field(default_factory=time.monotonic)
    error: ProtocolError | None = None


class RemoteRunner:
    """Args:
        remotes: the remote models (a client and a health probe each).
        wake: called (from the runner's thread) when an event waits: wakes the daemon's loop.
        probe_interval_s: how often each remote's ``/models`` is probed for the health it shows
            (0: at start only).
    """

    def __init__(self, remotes: list[RemoteModel], wake: Callable[[], None],
                 probe_interval_s: float = PROBE_INTERVAL_S) -> None:
        self.remotes, self._wake, self.probe_interval_s = remotes, wake, probe_interval_s
        self._events: queue.SimpleQueue[RemoteEvent] = queue.SimpleQueue()
        self._loop = asyncio.new_event_loop()
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._ready = threading.Event()
        self._failed: BaseException | None = None  # why the thread could not start
        self._thread = threading.Thread(target=self._run, name="llmd-remote", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise self._failed

    # ---- the loop's side -------------------------------------------------------------------------

    def start(self, request: RemoteRequest) -> None:
        """Send ``request``; its events come through :meth:`events`."""
        def begin() -> None:
            request.task = self._loop.create_task(self._stream(request))
        self._loop.call_soon_threadsafe(begin)

    def cancel(self, request: RemoteRequest) -> None:
        """Stop ``request``: its connection is closed (the server sees its client go); no more events."""
        def stop() -> None:
            if request.task is not None:
                request.task.cancel()
        self._loop.call_soon_threadsafe(stop)

    def events(self) -> list[RemoteEvent]:
        """What came back since the last call."""
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        """Cancel everything in flight and end the thread."""
        self._wake = lambda: None  # (the loop's wake pipe is about to close: never written after this)
        if not self._thread.is_alive():
            return
        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks(self._loop) if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*(client.aclose() for client in self._clients.values()), return_exceptions=True)
        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=5)
        except Exception:  # (closing anyway)
            log.warning("remote models: their connections did not close in time")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # ---- the runner's thread ---------------------------------------------------------------------

    def _run(self) -> None:
        import httpx

        asyncio.set_event_loop(self._loop)
        try:
            for remote in self.remotes:
                t = remote.table
                self._clients[remote.name] = httpx.AsyncClient(
                    base_url=t.url, headers=remote.headers, trust_env=False,  # (no proxies from the environment)
                    timeout=httpx.Timeout(connect=t.connect_timeout, read=t.read_timeout, write=t.read_timeout,
                                          pool=t.read_timeout),
                    limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=32))
                self._loop.create_task(self._probe_loop(remote))
        except BaseException as e:  # (said by __init__, on the daemon's thread)
            self._failed = e
            self._ready.set()
            self._loop.close()
            return
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()
        self._loop.close()

    def _emit(self, event: RemoteEvent) -> None:
        self._events.put(event)
        self._wake()

    async def _stream(self, request: RemoteRequest) -> None:
        import httpx

        remote = request.remote
        reader = StreamReader(chat=request.path == "/chat/completions")
        try:
            async with self._clients[remote.name].stream("POST", request.path, json=request.body) as response:
                if response.status_code != 200:
                    body = b""
                    async for part in response.aiter_bytes():
                        body += part
                        if len(body) >= MAX_ERROR_BODY_BYTES:
                            break
                    error = remote.error_for_status(response.status_code, body)
                    if error.code == ErrorCode.REMOTE_ERROR or response.status_code == 404:
                        remote.health.failing(str(error))
                    self._emit(RemoteEvent(request, "error", error=error))
                    return
                remote.health.ok(time.monotonic() - request.sent_at)
                self._emit(RemoteEvent(request, "accepted"))
                async for line in sse_lines(response.aiter_bytes()):
                    if not line.startswith("data:"):
                        continue  # (comments, event names, blank lines between events)
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    text = reader.feed(data)
                    if text:
                        self._emit(RemoteEvent(request, "text", text))
            if reader.finish_reason is None:
                raise ProtocolError(ErrorCode.REMOTE_ERROR, f"the remote model {remote.name}'s answer ended before "
                                                           "it said why (no finish_reason): the stream was cut")
            self._emit(RemoteEvent(request, "done", finish_reason=reader.finish_reason, usage=reader.usage,
                                   tool_calls=reader.tool_calls()))
        except asyncio.CancelledError:
            return  # cancelled: the daemon has answered the request already
        except ProtocolError as e:
            remote.health.failing(str(e))
            self._emit(RemoteEvent(request, "error", error=e))
        except httpx.HTTPError as e:
            error = _transport_error(remote, e, remote.table.read_timeout)
            remote.health.failing(str(error))
            self._emit(RemoteEvent(request, "error", error=error))
        except Exception as e:  # a bug must cost this request, never the runner's thread
            log.exception("remote request to %s failed", remote.name)
            self._emit(RemoteEvent(request, "error", error=ProtocolError(ErrorCode.INTERNAL,
                                                                          f"{type(e).__name__}: {e}")))

    async def _probe_loop(self, remote: RemoteModel) -> None:
        while True:
            try:
                await self._probe(remote)
            except Exception as e:  # a bug, or an answer nobody foresaw: the next probe tries again
                log.warning("probing the remote model %s failed: %s", remote.name, remote.scrub(f"{type(e).__name__}"
                                                                                                 f": {e}"))
            if self.probe_interval_s <= 0:
                return
            await asyncio.sleep(self.probe_interval_s)

    async def _probe(self, remote: RemoteModel) -> None:
        """``GET /models``: reachable, the key taken, and the model listed."""
        import httpx

        start, timeout = time.monotonic(), remote.table.connect_timeout
        try:
            async with self._clients[remote.name].stream("GET", "/models", timeout=timeout) as response:
                body = b""
                async for part in response.aiter_bytes():
                    body += part
                    if len(body) > MAX_PROBE_BYTES:
                        break
        except httpx.HTTPError as e:
            remote.health.failing(str(_transport_error(remote, e, timeout)))
            return
        if response.status_code != 200:
            remote.health.failing(str(remote.error_for_status(response.status_code, body)))
            return
        try:
            data = json.loads(body).get("data")
            ids = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else None
        except (ValueError, AttributeError):
            ids = None  # (not OpenAI's list: reachable and the key taken is all it says)
        listed = ids is None or remote.table.model in ids
        remote.health.ok(time.monotonic() - start, None if listed else
                         f"the server does not list {remote.table.model!r} in /models")


async def sse_lines(parts: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a server-sent event stream. NOTE: split on ``\\n`` alone (a ``\\r`` before it
    dropped), in bytes: a model's text may hold U+2028 or U+0085 raw inside a JSON string, where
    str.splitlines (httpx's aiter_lines) would cut the line. A line is at most MAX_LINE_BYTES.

    Raises:
        ProtocolError: ``remote_error``: a longer line.
    """
    pending: list[bytes] = []  # the unfinished line's parts (joined once its end comes: no quadratic copying)
    size = 0
    async for part in parts:
        if b"\n" in part:
            *lines, rest = b"".join([*pending, part]).split(b"\n")
            for line in lines:
                yield line.removesuffix(b"\r").decode("utf-8", "replace")
            pending, size = [rest], len(rest)
        else:
            pending.append(part)
            size += len(part)
        if size > MAX_LINE_BYTES:
            raise ProtocolError(ErrorCode.REMOTE_ERROR, f"the remote server sent a line of over {MAX_LINE_BYTES >> 20} "
                                                       "MiB: is its url an OpenAI-compatible API?")
    if size:
        yield b"".join(pending).removesuffix(b"\r").decode("utf-8", "replace")


def _transport_error(remote: RemoteModel, e: httpx.HTTPError, read_timeout: float) -> ProtocolError:
    """A failure below HTTP as llmd's typed error: no connection, a timeout, or a broken exchange.
    ``read_timeout``: the silence the exchange allowed."""
    import httpx

    where, t = f"the remote model {remote.name} ({remote.host})", remote.table
    if isinstance(e, httpx.ConnectTimeout):
        return ProtocolError(ErrorCode.REMOTE_TIMEOUT, f"{where} did not accept a connection within "
                                                      f"{t.connect_timeout:g}s (connect_timeout)")
    if isinstance(e, httpx.ReadTimeout):
        return ProtocolError(ErrorCode.REMOTE_TIMEOUT, f"{where} sent nothing for {read_timeout:g}s "
                                                      "(read_timeout in its [remote] table)")
    if isinstance(e, httpx.PoolTimeout):
        return ProtocolError(ErrorCode.REMOTE_TIMEOUT, f"{where}: {MAX_CONNECTIONS} requests to it are in flight "
                                                      f"and this one waited {read_timeout:g}s for a connection")
    if isinstance(e, httpx.TimeoutException):
        return ProtocolError(ErrorCode.REMOTE_TIMEOUT, f"{where} did not take the request within {read_timeout:g}s")
    if isinstance(e, httpx.ConnectError):
        return ProtocolError(ErrorCode.REMOTE_UNREACHABLE, remote.scrub(
            f"{where} cannot be reached ({e or type(e).__name__}): is the server running at {t.url}?"))
    return ProtocolError(ErrorCode.REMOTE_ERROR, remote.scrub(f"{where} broke the exchange: {type(e).__name__}: {e}"))
