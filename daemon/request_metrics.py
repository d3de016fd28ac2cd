"""How the daemon's requests ended and how long they took, since it started: counted here, in plain
numbers, and sent in ``stats`` replies; the HTTP front's ``/metrics`` turns them into Prometheus
counters and histograms (the runtime needs no metrics library)."""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

# Bucket edges (seconds), as vLLM's: TTFT from a cached prefix on a GPU to a long prompt on a CPU.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Counts per bucket (``le`` edges, not cumulative), their sum and count."""

    def __init__(self, edges: tuple[float, ...]) -> None:
        self.edges = edges
        self.counts = [0] * (len(edges) + 1)  # the last: above every edge
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1
        self.sum += value

    def to_dict(self) -> dict[str, Any]:
        """``buckets``: [edge, cumulative count] pairs, the last edge ``+Inf`` (as Prometheus has it)."""
        cumulative, total = [], 0
        for edge, count in zip([*self.edges, "+Inf"], self.counts):
            total += count
            cumulative.append([edge, total])
        return {"buckets": cumulative, "sum": self.sum, "count": total}


class RequestMetrics:
    """Outcomes (``stop``, ``length``, ``abort``, ``error``; ``refused`` by error code) and the
    latency histograms: time to first token, and each request's mean time between output tokens."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.itl = Histogram(ITL_BUCKETS_S)

    def finished(self, reason: str | None, ttft_s: float | None, e2e_s: float | None, num_tokens: int) -> None:
        self.outcomes[reason or "abort"] += 1
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if e2e_s is not None and num_tokens > 1:
                self.itl.observe(max(e2e_s - ttft_s, 0.0) / (num_tokens - 1))

    def failed(self) -> None:
        """A request the daemon ended with an error (a failed step, a shutdown's deadline)."""
        self.outcomes["error"] += 1

    def refuse(self, code: str) -> None:
        """A request refused before it started (bad, too long, queue full, shutting down)."""
        self.refused[code] += 1

    def to_dict(self) -> dict[str, Any]:
        return {"requests_finished": dict(self.outcomes), "requests_refused": dict(self.refused),
                "ttft_s": self.ttft.to_dict(), "itl_s": self.itl.to_dict()}
