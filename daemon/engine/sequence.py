"""The one object passed between scheduler, KV cache manager, model runner and engine.

A sequence has no prefill or decode phase: ``num_computed_tokens`` chases ``num_tokens`` (prompt
plus output so far). Whatever is not yet computed is scheduled, in chunks if it is long; when the
two meet, the step samples a token and ``num_tokens`` moves one ahead again.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.errors import RequestError


MIN_PRIORITY, MAX_PRIORITY = -10, 10  # a request's priority: higher is scheduled sooner


def check_priority(priority: Any) -> None:
    """Raises RequestError unless ``priority`` is an int in MIN_PRIORITY..MAX_PRIORITY (the engine's
    check, and the daemon's before it spends a tokenisation on the request)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise RequestError(f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, got {priority!r}")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the client or the engine


@dataclass(slots=True)
class Timings:
    """Wall-clock marks (``time.monotonic()``) of one request's life."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass(slots=True, eq=False)
class Sequence:
    """A request inside the engine. Identity semantics: two sequences are never equal."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    owner: Any = None  # the client that asked (the daemon's identity), opaque here
    priority: int = 0  # higher is scheduled sooner (MIN_PRIORITY..MAX_PRIORITY)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)  # the block table
    block_hashes: list[bytes] = field(default_factory=list)  # one per full block of token_ids
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    timings: Timings = field(default_factory=Timings)
    # speculative decoding: draft tokens at the end of token_ids, computed with the next token and
    # kept only as far as the model agrees (accept_drafts)
    num_draft_tokens: int = 0
    # over its life: verifications, draft tokens verified, and accepted among them
    num_verifications: int = 0
    num_drafts_verified: int = 0
    num_drafts_accepted: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def tokens_left(self, max_model_len: int) -> int:
        """The tokens it may still emit, its next one included, within max_tokens and a context of
        ``max_model_len``; drafts not yet verified count as not emitted."""
        emitted = self.num_tokens - self.num_draft_tokens
        return min(self.params.max_tokens - (emitted - len(self.prompt_token_ids)), max_model_len - emitted)

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:] if self.num_draft_tokens else []

    def add_drafts(self, draft: list[int]) -> None:
        """Guesses of the next tokens, to verify in the next step (scheduled with the last token)."""
        self.token_ids.extend(draft)
        self.num_draft_tokens += len(draft)

    def truncate_drafts(self, keep: int) -> None:
        """Keep only the first ``keep`` drafts, still to verify."""
        if keep < self.num_draft_tokens:
            del self.token_ids[len(self.token_ids) - self.num_draft_tokens + keep:]
            self.num_draft_tokens = max(keep, 0)

    def accept_drafts(self, num_accepted: int) -> None:
        """Keep the first ``num_accepted`` drafts as output tokens, drop the rest."""
        if not 0 <= num_accepted <= self.num_draft_tokens:
            raise ValueError(f"accepted {num_accepted} of {self.num_draft_tokens} drafts")
        del self.token_ids[len(self.token_ids) - self.num_draft_tokens + num_accepted:]
        self.num_verifications += 1
        self.num_drafts_verified += self.num_draft_tokens
        self.num_drafts_accepted += num_accepted
        self.num_draft_tokens = 0
        now = time.monotonic()
        if num_accepted and self.timings.first_token is None:
            self.timings.first_token = now
        self.timings.token_times.extend([now] * num_accepted)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        now = time.monotonic()
        if self.timings.first_token is None:
            self.timings.first_token = now
        self.timings.token_times.append(now)
