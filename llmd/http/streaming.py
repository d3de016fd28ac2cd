"""What the HTTP routes share about a request in flight: running it so that a client that hangs up
cancels it (its KV blocks are freed at once, not when it would have finished), and the daemon's
logprobs as token texts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request

from llmd.client import DaemonNotRunningError, Delta, Result, ServerError
from llmd.http.backend import Backend, ModelView

T = TypeVar("T")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client hangs up first (the AsyncClient then cancels the
    daemon's request). For answers sent whole; a streamed answer is cancelled by Starlette itself."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await task
    finally:
        watcher.cancel()


class Started:
    """A streamed request the daemon has accepted: the response can begin (headers, the first
    event) while the request still waits for its first token.

    Iterating gives the deltas and the result, and ends with an error event in place of the rest if
    the request fails once the response has begun (``error_event``). Leaving early (the client hung
    up, and Starlette cancelled the response) cancels the request in the daemon at once.
    """

    def __init__(self, stream: AsyncIterator[Delta | Result], head: asyncio.Future[Delta | Result]) -> None:
        self._stream, self._head = stream, head

    @classmethod
    async def start(cls, make: Callable[[Callable[[dict[str, Any]], None]], AsyncIterator[Delta | Result]]
                    ) -> Started:
        """``make(on_accepted)`` starts the request; returns once it is accepted.

        Raises:
            ServerError: the daemon refused it (an HTTP error: nothing has been sent yet).
        """
        accepted = asyncio.Event()
        stream = make(lambda _: accepted.set())
        head = asyncio.ensure_future(stream.__anext__())
        waiter = asyncio.ensure_future(accepted.wait())
        try:
            await asyncio.wait({head, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            await _close(stream, head)
            raise
        finally:
            waiter.cancel()
        if head.done() and head.exception() is not None and not isinstance(head.exception(), StopAsyncIteration):
            await _close(stream, head)
            head.result()  # the refusal
        return cls(stream, head)

    async def items(self, error_event: Callable[[Exception], bytes]) -> AsyncIterator[Delta | Result | bytes]:
        try:
            try:
                yield await self._head
            except StopAsyncIteration:
                return
            async for item in self._stream:
                yield item
        except (ServerError, DaemonNotRunningError) as e:
            yield error_event(e)
        finally:
            await _close(self._stream, self._head)


async def _close(stream: AsyncIterator[Any], head: asyncio.Future[Any]) -> None:
    """Stop a request's stream: its pending read first (a generator cannot close while it runs)."""
    if not head.done():
        head.cancel()
    with contextlib.suppress(BaseException):
        await head
    await stream.aclose()  # type: ignore[attr-defined]


async def token_logprobs(backend: Backend | ModelView, token_ids: list[int], logprobs: list[Any] | None
                         ) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """The daemon's logprobs (per token ``[logprob, [[token_id, logprob], ...]]``) with each token's
    text: ``(text, logprob, [(text, logprob), ...])``."""
    if not logprobs:
        return []
    ids = list(token_ids[:len(logprobs)])
    alternatives = [t for _, top in logprobs for t, _ in top]
    texts = dict(zip(ids + alternatives, await backend.pieces(ids + alternatives)))
    return [(texts[t], float(lp), [(texts[a], float(alp)) for a, alp in top])
            for t, (lp, top) in zip(ids, logprobs)]


def finish_reason(reason: str | None) -> str:
    """OpenAI's finish reasons are ``stop``, ``length`` and ``tool_calls``; an aborted request
    reads as stopped."""
    return reason if reason in ("length", "tool_calls") else "stop"
