"""What the engine hands out: per-step deltas while streaming, whole results at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmd.daemon.engine.sequence import Sequence
from llmd.daemon.engine.stats import accepted_length, acceptance_rate

Logprob = tuple[float, list[tuple[int, float]]]  # (sampled token's logprob, top-n (token, logprob))


@dataclass(slots=True)
class RequestMetrics:
    """Timings in seconds. ``token_times`` are offsets from arrival, one per generated token."""

    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    num_preemptions: int
    queue_time: float | None
    ttft: float | None
    e2e: float | None
    token_times: list[float]
    # speculative decoding: verifications, draft tokens verified and accepted (0 without it)
    num_verifications: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    @property
    def draft_acceptance_rate(self) -> float | None:
        return acceptance_rate(self.num_draft_tokens, self.num_accepted_draft_tokens)

    @property
    def mean_accepted_length(self) -> float | None:
        return accepted_length(self.num_verifications, self.num_accepted_draft_tokens)

    @property
    def decode_tokens_per_s(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        span = self.token_times[-1] - self.token_times[0]
        return (len(self.token_times) - 1) / span if span > 0 else None

    @classmethod
    def of(cls, seq: Sequence) -> RequestMetrics:
        t = seq.timings
        return cls(
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_generated_tokens=seq.num_output_tokens,
            num_preemptions=seq.num_preemptions,
            queue_time=t.queue_time,
            ttft=t.ttft,
            e2e=None if t.finished is None else t.finished - t.arrival,
            token_times=[x - t.arrival for x in t.token_times],
            num_verifications=seq.num_verifications,
            num_draft_tokens=seq.num_drafts_verified,
            num_accepted_draft_tokens=seq.num_drafts_accepted,
        )


@dataclass(slots=True)
class RequestDelta:
    """New output of one request in one step. The last one has ``finished`` and ``metrics``, and
    ``prompt_logprobs`` when they were asked for (None for the first prompt token)."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[Logprob] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[Logprob | None] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A finished request, as :meth:`llmd.LLM.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None
