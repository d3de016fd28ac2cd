"""Continuous batching with chunked prefill, fair between clients, and preemption by recompute.

Each step spends one token budget; prompt chunks and decode tokens share one ragged batch.

1. Decodes first, one token each: they are cheap, and someone is watching them stream.
2. The rest goes to prompt work (running prompts and waiting requests), higher priority first.
   Within a priority it is split max-min fairly between owners (clients): an owner that needs less
   than an equal share gets all it needs, the others split the rest evenly. One client's long
   prompts cannot take the whole budget while another client has work: a short request that fits
   starts in the step after it arrives, however much is queued ahead of it.
   When the budget cannot give every owner ``min_chunk_tokens``, owners take turns instead: those
   not served since their work arrived, then the least recently served, get chunks of at least that size
   this step, the others in the next ones. Thin slices for everyone would make every prompt finish
   last (32 clients, 128-token prompts: all first tokens at once, after 11.6 s instead of from
   0.5 s on) and cost each sequence's per-chunk overhead 32 times over.
3. Each owner spends its share on its own work, shortest remainder first, so a long prompt is
   chunked behind short ones, not in front of them. A waiting request is admitted when its turn
   comes, if there is a slot and the blocks for its whole remaining prompt; a share an owner
   cannot use is split again among the others.

Admission reserves the whole prompt's blocks because a half-computed prompt that cannot grow forces
a preemption, and its chunks are computed again later: a few long prompts thrash. A request that
does not fit is skipped, never holding back smaller ones behind it, but it keeps its place
(priority, then arrival): once ``max_num_seqs`` requests from behind it have been admitted, no
more of its priority or lower are until it is, so it cannot starve.

A token budget bounds a step's work, not its time: on a CPU, 512 prompt tokens at a 7,000-token
context take seconds, and every other client waits that long for each token, a new request as long
for the step in flight to end. So a step's prompt tokens are also cut to end in about
``step_seconds`` while more than one owner has work, ``lone_step_seconds`` otherwise, at the rate
the last step with prompt work ran (the first such step, before any rate is known, takes at most
PROBE_PACED_TOKENS).

When the pool runs dry for a decode's next block, a running sequence is preempted: of the lowest
priority, of the owner holding the most blocks, the most recently admitted. Its blocks are freed and
it waits in its old place to be recomputed (its prefix may well still be in the cache); nothing is
admitted in that step, which would only thrash.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

from llmd.config import OPTIONS
from llmd.daemon.engine.kv_cache_manager import KVCacheManager
from llmd.daemon.engine.sequence import FinishReason, Sequence, SequenceStatus


MIN_PACED_TOKENS = 16  # prompt tokens a paced step still takes, however slow the last one was
# Prompt tokens a paced step takes before any rate is measured: a probe. The whole budget was ~15 s
# for a 3B's first 512 tokens on 2 cores, and every client waited that long, past its silence timeout.
PROBE_PACED_TOKENS = 64


@dataclass(slots=True)
class SchedulerConfig:
    """Batching limits. Raises ``ValueError`` on nonsense values.

    Attributes:
        step_seconds: about how long a step may take while more than one owner has work: each
            streaming client's time between tokens.
        lone_step_seconds: the same for one owner: what a request arriving meanwhile waits for the
            step in flight. None, for either: the token budget alone.
        min_chunk_tokens: the smallest share of prompt work worth giving an owner in a step; when
            the budget is too small for all of them, owners take turns (module docstring).
    """

    max_num_seqs: int = OPTIONS["max_num_seqs"].default
    max_batched_tokens: int = OPTIONS["max_batched_tokens"].default
    max_model_len: int = 2048
    step_seconds: float | None = 0.2
    lone_step_seconds: float | None = 1.0
    min_chunk_tokens: int = 128

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_batched_tokens", "max_model_len", "min_chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("step_seconds", "lone_step_seconds"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")


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


def fair_shares(demands: dict[Any, int], budget: int) -> dict[Any, int]:
    """Split ``budget`` tokens max-min fairly between owners: smallest demand first, each gets what
    it asks for or an equal share of what is left, whichever is less.

    Returns:
        owner -> tokens; they sum to ``min(budget, sum(demands.values()))``.
    """
    shares = {}
    owners = sorted(demands, key=demands.__getitem__)
    for i, owner in enumerate(owners):
        shares[owner] = min(demands[owner], budget // (len(owners) - i))
        budget -= shares[owner]
    return shares


def _num_left(seq: Sequence) -> int:
    return seq.num_tokens - seq.num_computed_tokens


def _is_decode(seq: Sequence) -> bool:
    """Its next token, and the draft tokens to verify with it (speculative decoding)."""
    return _num_left(seq) == 1 + seq.num_draft_tokens


def _place(seq: Sequence) -> tuple[int, float]:
    """A waiting sequence's place in the queue: priority, then arrival (a preempted one keeps it)."""
    return -seq.priority, seq.timings.arrival


def _spare_slots(seq: Sequence, block_size: int) -> tuple[int, int]:
    """A decoding sequence's KV slots past its own next token once it has them, and the new blocks
    that token takes (none, or one at a block's edge)."""
    spare = len(seq.block_ids) * block_size - (seq.num_computed_tokens + 1)
    need = -(-max(-spare, 0) // block_size)
    return spare + need * block_size, need


@dataclass(frozen=True, slots=True)
class DraftRoom:
    """What the next step leaves for draft tokens (:meth:`Scheduler.room_for_drafts`).

    Attributes:
        tokens: draft tokens the step could verify in all.
        free_slots: KV slots in the blocks the pool keeps after the sequences' own tokens and
            admission: what any sequence's drafts may take beyond its own blocks.
        block_size: tokens per KV block.
    """

    tokens: int
    free_slots: int
    block_size: int

    def for_seq(self, seq: Sequence) -> int:
        """The drafts ``seq`` could verify: the step's room, and the slots its own blocks have past
        its next token and the pool's (another sequence's spare slots are not its)."""
        return min(self.tokens, _spare_slots(seq, self.block_size)[0] + self.free_slots)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: list[Sequence] = []  # in their places (see _place)
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0  # since start
        self.num_prefix_hit_tokens = 0  # prompt tokens served from the cache, since start
        self.num_prefix_query_tokens = 0  # prompt tokens looked up, since start
        self._num_passed: dict[Sequence, int] = {}  # waiting, did not fit -> admissions from behind it
        # this step's state, for _admit
        self._blocker: Sequence | None = None
        self._preempted = False
        # pacing: how fast the last step with prompt work ran
        self._paced_tokens_per_s: float | None = None
        self._num_paced_tokens = 0  # in the step scheduled last: its prompt tokens and the drafts beside them
        self._scheduled_at = 0.0
        self._served_at: dict[Any, float] = {}  # owner -> when it was last granted prompt work

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_place)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        self._preempted = self._make_room()
        limit = self.config.max_num_seqs
        self._blocker = min((s for s, n in self._num_passed.items() if n >= limit), key=_place, default=None)
        if self._blocker is not None:
            self._admit(self._blocker)  # first in, the moment it fits
        batch = ScheduledBatch()
        budget = self.config.max_batched_tokens
        drafted: list[int] = []  # batch rows with draft tokens, given what the prompt work leaves
        for seq in sorted(self.running, key=lambda s: -s.priority):
            if budget and _is_decode(seq):
                if seq.num_draft_tokens:
                    drafted.append(len(batch.seqs))
                batch.seqs.append(seq)
                batch.num_new_tokens.append(1)
                budget -= 1
            elif seq.num_draft_tokens:  # not scheduled: its guesses would be stale by its turn
                self._drop_drafts(seq)
        unpaced = budget
        work = [seq for seq in self.running if not _is_decode(seq)]
        if not self._preempted and len(self.running) < limit:
            work += self.waiting
        work.sort(key=lambda s: (-s.priority, _num_left(s), s.timings.arrival))
        budget = min(budget, self._paced_tokens())
        owners = {seq.owner for seq in work}
        self._served_at = {o: t for o, t in self._served_at.items() if o in owners}
        grants: dict[Sequence, int] = {}
        for _, same_priority in itertools.groupby(work, key=lambda s: s.priority):
            queues: dict[Any, list[Sequence]] = {}  # owner -> its work, the next one last
            for seq in reversed(list(same_priority)):
                queues.setdefault(seq.owner, []).append(seq)
            budget = self._share(queues, budget, grants)
        batch.seqs += grants
        batch.num_new_tokens += grants.values()
        # Drafts last: speculation never takes budget from prompt work (another request's first token),
        # nor its time. A step with prompt work gives drafts only what its paced budget leaves, as it
        # would give more prompt tokens: with the unpaced budget's rest, drafts stretched such steps
        # past their target, and the rate measured over them then cut the next steps' prompt tokens
        # to a few (tests/test_scheduler_fairness.py). A step without prompt work paces nothing.
        prompt_tokens = sum(grants.values())
        left = budget if prompt_tokens else unpaced
        drafts = 0
        for row in drafted:
            seq = batch.seqs[row]
            keep = min(seq.num_draft_tokens, left)
            # their slots too come last, from the blocks the pool has left: as many drafts as fit
            while keep and self.kv.allocate_slots(seq, 1 + keep) is None:
                keep -= 1
            if keep < seq.num_draft_tokens:
                seq.truncate_drafts(keep)
                self.kv.trim(seq)
            batch.num_new_tokens[row] += keep
            left -= keep
            drafts += keep
        # the paced tokens the step's time is measured over: its drafts ran in the prompt's time
        self._num_paced_tokens = prompt_tokens + drafts if prompt_tokens else 0
        self._scheduled_at = time.monotonic()
        return batch

    def room_for_drafts(self) -> DraftRoom:
        """About how many draft tokens the next step could verify, as :meth:`schedule` will share
        its budget and the pool: the tokens left after the running sequences' own and, paced, the
        prompt work: unfinished prompts, and the waiting ones admission would take (a seat free,
        their blocks in the pool after their prefix-cache hits, not held back behind a blocker). A
        prompt waiting for blocks takes nothing from the drafts, which speed the sequences whose end
        frees them. Drafts get their KV slots last, so the room also counts the slots left: in each
        decoding sequence's blocks past its own token, and in the blocks the pool keeps after those
        tokens' and admission's (with the pool dry, a draft model's passes made drafts that got
        no slots)."""
        bs = self.kv.block_size
        decodes, spare_slots, own_blocks = 0, 0, 0
        for seq in self.running:
            if _is_decode(seq):
                spare, need = _spare_slots(seq, bs)
                decodes, spare_slots, own_blocks = decodes + 1, spare_slots + spare, own_blocks + need
        prompts = sum(_num_left(seq) for seq in self.running if not _is_decode(seq))
        seats, blocker = self.config.max_num_seqs - len(self.running), self._blocker
        free = self.kv.pool.num_free_blocks - own_blocks
        for seq in sorted(self.waiting, key=_place):
            if not seats or (blocker is not None and seq is not blocker and seq.priority <= blocker.priority):
                continue
            hits, num_cached = self.kv.get_computed_blocks(seq)  # (as _admit will find them)
            need = self.kv.blocks_needed(seq, seq.num_tokens - num_cached, hits)
            if need <= free:
                prompts, seats, free = prompts + seq.num_tokens - num_cached, seats - 1, free - need
        budget = max(0, self.config.max_batched_tokens - decodes)
        tokens = budget if not prompts else max(0, min(budget, self._paced_tokens()) - prompts)
        free_slots = max(free, 0) * bs
        return DraftRoom(min(tokens, spare_slots + free_slots), free_slots, bs)

    def _paced_tokens(self) -> int:
        """The prompt tokens the next step may take to end in time (module docstring)."""
        cfg = self.config
        shared = len({s.owner for s in self.running + self.waiting}) > 1
        seconds = cfg.step_seconds if shared else cfg.lone_step_seconds
        if seconds is None:
            return cfg.max_batched_tokens
        if self._paced_tokens_per_s is None:
            return min(cfg.max_batched_tokens, PROBE_PACED_TOKENS)
        # NOTE: the rate includes each step's fixed cost, so if a step costs fixed + n * per_token,
        # steps settle at the n that takes ``seconds``.
        return max(MIN_PACED_TOKENS, int(self._paced_tokens_per_s * seconds))

    def _share(self, queues: dict[Any, list[Sequence]], budget: int, grants: dict[Sequence, int]) -> int:
        """Grant up to ``budget`` tokens to the owners' queues, max-min fairly between owners,
        admitting waiting sequences as their turn comes; returns the budget left."""
        while budget and queues:
            demands = {owner: sum(_num_left(s) - grants.get(s, 0) for s in queues[owner])
                       for owner in self._turn(queues, budget)}
            now = time.monotonic()
            for owner, share in fair_shares(demands, budget).items():
                queue = queues[owner]
                self._served_at[owner] = now
                while share and queue:
                    seq = queue[-1]
                    if seq.status is SequenceStatus.WAITING and not self._admit(seq):
                        queue.pop()  # the share goes to the owner's next one
                        continue
                    num_new = min(_num_left(seq) - grants.get(seq, 0), share)
                    grants[seq] = grants.get(seq, 0) + num_new
                    share -= num_new
                    budget -= num_new
                    if grants[seq] == _num_left(seq):
                        queue.pop()
                if not queue:
                    del queues[owner]  # what it could not use is shared again among the rest
        return budget

    def _turn(self, queues: dict[Any, list[Sequence]], budget: int) -> list[Any]:
        """The owners to share ``budget`` between now: all of them if each can have
        ``min_chunk_tokens``, else as many as can, least recently served first (one not served since
        its work arrived before all others: a new client's first tokens come soonest), then the
        shortest next piece of work, the earliest."""
        room = max(1, budget // self.config.min_chunk_tokens)
        if len(queues) <= room:
            return list(queues)

        def since(owner: Any) -> tuple[float, int, float]:
            head = queues[owner][-1]
            return self._served_at.get(owner, -math.inf), _num_left(head), head.timings.arrival

        return sorted(queues, key=since)[:room]

    def _admit(self, seq: Sequence) -> bool:
        """Move a waiting sequence to running if there is a slot and the blocks for its whole
        remaining prompt fit; if not, it starts counting the admissions from behind it."""
        blocker = self._blocker
        if self._preempted or (blocker is not None and seq is not blocker and seq.priority <= blocker.priority):
            return False
        fits = len(self.running) < self.config.max_num_seqs
        if fits:
            computed_blocks, num_cached = self.kv.get_computed_blocks(seq)
            fits = self.kv.allocate_slots(seq, seq.num_tokens - num_cached, computed_blocks) is not None
        if not fits:
            self._num_passed.setdefault(seq, 0)
            return False
        self._num_passed.pop(seq, None)
        for other in self._num_passed:
            if _place(other) < _place(seq):
                self._num_passed[other] += 1
        if seq is blocker:
            self._blocker = None
        self.waiting.remove(seq)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_cached
            self.num_prefix_hit_tokens += num_cached
            self.num_prefix_query_tokens += seq.num_prompt_tokens
        seq.num_computed_tokens = num_cached
        seq.status = SequenceStatus.RUNNING
        if seq.timings.first_scheduled is None:
            seq.timings.first_scheduled = time.monotonic()
        self.running.append(seq)
        return True

    def _make_room(self) -> bool:
        """Give every running sequence the blocks for its uncomputed tokens (a prompt has them
        since admission; a decode may need one), preempting when the pool is dry. Returns
        whether anything was preempted. Draft tokens are left out: they get blocks in
        :meth:`schedule`, from what prompt work and admission leave (a draft's block taken here
        preempted another sequence for its own token, or kept a waiting prompt out)."""
        preempted = False
        for seq in list(self.running):
            while (seq.status is SequenceStatus.RUNNING
                   and self.kv.allocate_slots(seq, _num_left(seq) - seq.num_draft_tokens) is None):
                victim = self._pick_victim()
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
        return preempted

    def _pick_victim(self) -> Sequence:
        held: dict[Any, int] = {}
        for seq in self.running:
            held[seq.owner] = held.get(seq.owner, 0) + len(seq.block_ids)
        # min() keeps the first of equals, so the newest wins ties
        return min(reversed(self.running), key=lambda s: (s.priority, -held[s.owner]))

    def _drop_drafts(self, seq: Sequence) -> None:
        seq.truncate_drafts(0)  # unverified: not counted as rejected
        self.kv.trim(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Free a sequence taken out of ``running`` and queue it for recompute in its old place."""
        seq.truncate_drafts(0)  # a guess must not be recomputed as if it were the prompt
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_place)

    def update(self, batch: ScheduledBatch, sampled: list[int | None]) -> None:
        """Advance each scheduled sequence after the model ran: its computed tokens, its cached
        blocks, and the token it sampled (None while its prompt is not done). Whether that token
        ends it is the engine's call (it alone sees the text, for stop strings): :meth:`finish`."""
        seconds = time.monotonic() - self._scheduled_at  # the model's run: called right after it
        if self._num_paced_tokens >= MIN_PACED_TOKENS:
            self._paced_tokens_per_s = self._num_paced_tokens / max(seconds, 1e-9)
        for seq, num_new, token in zip(batch.seqs, batch.num_new_tokens, sampled):
            if seq.is_finished:  # aborted while the step ran
                continue
            if seq.num_draft_tokens:
                raise ValueError("verify the drafts (Sequence.accept_drafts) before update()")
            # NOTE: a verified row computed its drafts too; only the accepted ones stay computed
            # (the engine took the rest out and trimmed their blocks: LLMEngine._accept)
            seq.num_computed_tokens = min(seq.num_computed_tokens + num_new, seq.num_tokens)
            self.kv.cache_computed_blocks(seq)
            if token is not None:
                seq.append_token(token)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (stop, length or abort) wherever it is and free its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
            self._num_passed.pop(seq, None)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.timings.finished = time.monotonic()
