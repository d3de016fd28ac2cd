"""Continuous batching with chunked prefill and preemption by recompute.

Each step spends one token budget: running sequences first (a decode costs 1 token, an unfinished
prompt as much of its remainder as fits), then waiting ones in arrival order. Prompt chunks and
decode tokens share one ragged batch. When the pool runs dry, the most recently admitted running
sequence is preempted: its blocks are freed and it waits at the front of the queue to be
recomputed (its prefix may well still be in the cache).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from llmd.daemon.engine.kv_cache_manager import KVCacheManager
from llmd.daemon.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    """Batching limits. Raises ``ValueError`` on nonsense values."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: each sequence with how many of its uncomputed tokens to run."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # since start
        self.num_prefix_hit_tokens = 0  # prompt tokens served from the cache, since start
        self.num_prefix_query_tokens = 0  # prompt tokens looked up, since start

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while self.kv.allocate_slots(seq, num_new) is None:
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
        # NOTE: after a preemption the pool is tight; admitting new work now would only thrash.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            computed_blocks, num_cached = self.kv.get_computed_blocks(seq)
            num_new = min(seq.num_tokens - num_cached, budget)
            if self.kv.allocate_slots(seq, num_new, computed_blocks) is None:
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
                self.num_prefix_hit_tokens += num_cached
                self.num_prefix_query_tokens += seq.num_prompt_tokens
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            if seq.timings.first_scheduled is None:
                seq.timings.first_scheduled = time.monotonic()
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Advance each scheduled sequence after the model ran; returns those that finished.

        Args:
            sampled: per scheduled sequence, the new token, or None if its prompt is not done.
        """
        finished = []
        for seq, num_new, token in zip(batch.seqs, batch.num_new_tokens, sampled):
            if seq.is_finished:  # aborted while the step ran
                continue
            seq.num_computed_tokens += num_new
            self.kv.cache_computed_blocks(seq)
            if token is None:
                continue
            seq.append_token(token)
            reason = self._check_stop(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _check_stop(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if (not params.ignore_eos and token in seq.eos_token_ids) or token in params.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (stop, length or abort) wherever it is and free its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.timings.finished = time.monotonic()
