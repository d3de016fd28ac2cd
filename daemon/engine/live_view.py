"""What the engine is doing right now, compactly, for `llmd chat`'s dashboard: the state of every KV
block and a row per running or waiting request.

The block map is one byte per block (its codes are wire format: llmd.protocol), so a pool of
3,000 blocks costs 3 kB per stats message:

    0 free          empty, or its prefix was evicted
    1 cached        free, but holding a reusable prefix (a later request with that prefix skips it)
    2 shared        in use by more than one request (a prefix-cache hit in flight)
    3 + i           in use by request ``i`` of the rows (the running ones come first)
    255             in use by a request past the first 252 rows

Built by walking the cached blocks and the running sequences' block tables: O(blocks), no state
kept between calls, a fraction of a millisecond for thousands of blocks.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from llmd.daemon.engine.block_pool import BlockPool
from llmd.daemon.engine.sequence import Sequence
from llmd.protocol import BLOCK_CACHED, BLOCK_FIRST_OWNER, BLOCK_OTHER, BLOCK_SHARED, MAX_OWNER_ROWS


@dataclass(slots=True, frozen=True)
class RequestRow:
    """One request as the dashboard's table shows it. Times in seconds; None until known."""

    request_id: str
    state: str  # "running" or "waiting"
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    tokens_per_s: float | None  # decode rate since its first token
    ttft: float | None
    format: str | None = None  # its response format's type (structured output), or None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _row(seq: Sequence, state: str, now: float) -> RequestRow:
    t = seq.timings
    rate = None
    if t.first_token is not None and seq.num_output_tokens > 1 and now > t.first_token:
        rate = (seq.num_output_tokens - 1) / (now - t.first_token)
    fmt = seq.params.response_format
    return RequestRow(seq.request_id, state, seq.num_prompt_tokens, seq.num_cached_tokens, seq.num_output_tokens,
                      rate, t.ttft, None if fmt is None else fmt.kind)


def request_rows(running: list[Sequence], waiting: list[Sequence], limit: int) -> list[RequestRow]:
    """Running requests (in admission order), then waiting ones (in their queue places: priority,
    then arrival), at most ``limit``."""
    now = time.monotonic()
    rows = [_row(seq, "running", now) for seq in running[:limit]]
    rows += [_row(seq, "waiting", now) for seq in waiting[:max(0, limit - len(rows))]]
    return rows


def block_map(pool: BlockPool, running: list[Sequence]) -> bytes:
    """One byte per block (module docstring); request ``i`` is ``running[i]``."""
    states = bytearray(pool.num_blocks)  # all BLOCK_FREE
    for block in pool.cached.values():
        if block.ref_cnt == 0:
            states[block.block_id] = BLOCK_CACHED
    for i, seq in enumerate(running):
        owner = BLOCK_FIRST_OWNER + i if i < MAX_OWNER_ROWS else BLOCK_OTHER
        for block_id in seq.block_ids:
            # a block already marked by an earlier request is shared (a prefix hit)
            states[block_id] = owner if states[block_id] < BLOCK_SHARED else BLOCK_SHARED
    return bytes(states)
