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
    # speculative decoding, since start: verified rows, draft tokens verified, accepted among them
    num_verifications: int = 0
    num_draft_tokens_total: int = 0
    num_accepted_draft_tokens_total: int = 0
    # blocks handed out at least once since the KV cache was made: on the CPU, the pool's resident part
    num_blocks_touched: int = 0

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted / verified draft tokens; None before any draft."""
        return acceptance_rate(self.num_draft_tokens_total, self.num_accepted_draft_tokens_total)

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verification produces on average: the accepted drafts and the model's own."""
        return accepted_length(self.num_verifications, self.num_accepted_draft_tokens_total)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "draft_acceptance_rate": self.draft_acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length}


def acceptance_rate(drafted: int, accepted: int) -> float | None:
    """Speculative decoding's accepted share of the verified draft tokens (None without drafts)."""
    return accepted / drafted if drafted else None


def accepted_length(verifications: int, accepted: int) -> float | None:
    """Tokens per verification: the accepted drafts and the model's own one (None without any)."""
    return 1 + accepted / verifications if verifications else None


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
