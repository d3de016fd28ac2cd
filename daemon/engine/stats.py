"""Engine statistics for the daemon's status and the UI: pool state, cache hits, throughput."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_blocks: int
    block_size: int
    num_blocks_used: int
    num_blocks_cached_free: int
    num_blocks_free: int  # includes the cached-free ones
    num_running: int
    num_waiting: int
    num_preemptions: int  # since start
    prefix_cache_hit_rate: float  # prompt tokens served from the cache / prompt tokens, since start
    prefill_tokens_per_s: float  # over the last few seconds
    decode_tokens_per_s: float
    num_prompt_tokens_total: int
    num_generated_tokens_total: int
    num_steps: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ThroughputMeter:
    """Tokens per second over a sliding window of recent steps (decays to 0 when idle)."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._steps: deque[tuple[float, int, int]] = deque()  # (step start time, prefill, decode)
        self.num_prefill_total = 0
        self.num_decode_total = 0
        self.num_steps = 0

    def record(self, start: float, num_prefill: int, num_decode: int) -> None:
        self._steps.append((start, num_prefill, num_decode))
        self.num_prefill_total += num_prefill
        self.num_decode_total += num_decode
        self.num_steps += 1

    def rates(self, now: float | None = None) -> tuple[float, float]:
        """(prefill, decode) tokens per second: tokens of the steps that started within the
        window, over the time since the earliest of them started."""
        now = time.monotonic() if now is None else now
        while self._steps and now - self._steps[0][0] > self.window_s:
            self._steps.popleft()
        if not self._steps:
            return 0.0, 0.0
        span = max(now - self._steps[0][0], 1e-6)
        return sum(s[1] for s in self._steps) / span, sum(s[2] for s in self._steps) / span
