"""What the HTTP routes share about a request in flight: running it so that a client that hangs up
cancels it (its KV blocks are freed at once, not when it would have finished), and the daemon's
logprobs as token texts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

from llmd.client import Delta, Result
from llmd.http.backend import Backend

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


async def deltas(stream: AsyncIterator[Delta | Result]) -> AsyncIterator[Delta | Result]:
    """The request's deltas and its result; closing this (a hang-up cancels the response's task)
    closes the client's stream at once, which cancels the request in the daemon."""
    async with contextlib.aclosing(stream):
        async for item in stream:
            yield item


async def token_logprobs(backend: Backend, token_ids: list[int], logprobs: list[Any] | None
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
    """OpenAI's finish reasons are ``stop`` and ``length`` (and tool calls); an aborted request
    reads as stopped."""
    return "length" if reason == "length" else "stop"
