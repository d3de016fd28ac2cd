"""The scheduler shares each step between clients (owners) and priorities: a short request is not
stuck behind another client's long prompts, a request that does not fit does not block smaller ones
and is not starved, decodes run every step, preemption takes from the owner holding the most, and
steps are paced to a time as well as a token budget.

The scheduler runs without a model here: a step "computes" what was scheduled and samples token 7
when a sequence's last token was computed (every request ignores EOS and stops at max_tokens).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from llmd.daemon.engine.kv_cache_manager import KVCacheManager
from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from llmd.daemon.engine.sequence import FinishReason, Sequence, SequenceStatus

_prompt_seeds = itertools.count(1)


def make_seq(rid: str, num_tokens: int, owner: Any = None, priority: int = 0, max_tokens: int = 4) -> Sequence:
    """A request with a prompt of its own (no prefix shared with any other)."""
    seed = next(_prompt_seeds) * 7919
    prompt = [(seed + i * 31) % 250 + 1 for i in range(num_tokens)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence(rid, prompt, params, owner=owner, priority=priority)


def make_scheduler(num_blocks: int = 4096, block_size: int = 16, max_num_seqs: int = 64,
                   max_batched_tokens: int = 512, paced: bool = False) -> Scheduler:
    """Unpaced unless asked: these steps take no time, so only the token budget shapes them (a paced
    scheduler's first step is a probe of PROBE_PACED_TOKENS)."""
    timing = {} if paced else {"step_seconds": None, "lone_step_seconds": None}
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                             max_model_len=8192, **timing)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, prefix_cache=False))


def end_finished(sched: Scheduler, batch: ScheduledBatch) -> None:
    """What the engine does after an update (LLMEngine._check_stop; these requests ignore EOS and
    have no stop strings): end the sequences whose output reached max_tokens."""
    for seq in batch.seqs:
        if not seq.is_finished and seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, FinishReason.LENGTH)


def step(sched: Scheduler) -> dict[str, int]:
    """One step without a model; returns each scheduled request's number of tokens."""
    batch = sched.schedule()
    sampled = [7 if seq.num_computed_tokens + n == seq.num_tokens else None
               for seq, n in zip(batch.seqs, batch.num_new_tokens)]
    sched.update(batch, sampled)
    end_finished(sched, batch)
    assert batch.num_tokens <= sched.config.max_batched_tokens
    assert len(batch.seqs) == len(set(map(id, batch.seqs))), "a sequence scheduled twice in one step"
    return {seq.request_id: n for seq, n in zip(batch.seqs, batch.num_new_tokens)}


def add_all(sched: Scheduler, seqs: list[Sequence]) -> list[Sequence]:
    for seq in seqs:
        sched.add(seq)
    return seqs


def test_short_request_of_another_owner_is_not_stuck_behind_long_prompts() -> None:
    # The measured problem: one client's four 7,000-token prompts, another client's 4-token request.
    sched = make_scheduler()
    long_ones = add_all(sched, [make_seq(f"a{i}", 7000, owner="A", max_tokens=16) for i in range(4)])
    for _ in range(3):
        step(sched)
    short = add_all(sched, [make_seq("b", 4, owner="B", max_tokens=8)])[0]
    first = step(sched)
    assert first["b"] == 4, "the short request's whole prompt runs in the step after it arrives"
    assert sum(n for rid, n in first.items() if rid.startswith("a")) == 512 - 4, "A keeps the rest"
    for _ in range(7):
        step(sched)
    assert short.is_finished and short.num_output_tokens == 8, "8 tokens in 8 steps"
    assert not any(seq.is_finished for seq in long_ones)


def test_long_prompt_is_chunked_behind_short_ones() -> None:
    sched = make_scheduler()
    long_one = add_all(sched, [make_seq("long", 3000)])[0]
    step(sched)
    add_all(sched, [make_seq("s10", 10), make_seq("s20", 20), make_seq("s30", 30)])
    got = step(sched)
    assert (got["s10"], got["s20"], got["s30"]) == (10, 20, 30)
    assert got["long"] == 512 - 60
    assert long_one.num_computed_tokens == 512 + 452


def test_decodes_run_every_step_while_another_owner_prefills() -> None:
    sched = make_scheduler()
    add_all(sched, [make_seq(f"b{i}", 3000, owner="B") for i in range(4)])
    step(sched)
    chat = add_all(sched, [make_seq(f"a{i}", 12, owner="A", max_tokens=20) for i in range(3)])
    for i in range(20):
        got = step(sched)
        for seq in chat:
            assert got[seq.request_id] == (12 if i == 0 else 1), f"step {i}: {seq.request_id} left out"
        assert sum(n for rid, n in got.items() if rid.startswith("b")) == 512 - (36 if i == 0 else 3)
    assert all(seq.is_finished and seq.num_output_tokens == 20 for seq in chat)


@pytest.mark.parametrize("first_owner", ["A", None])  # None (in-process use) is one owner like any other
def test_budget_is_split_fairly_between_owners_over_many_steps(first_owner: Any) -> None:
    sched = make_scheduler()
    add_all(sched, [make_seq(f"x{i}", 4000, owner=first_owner) for i in range(6)])
    add_all(sched, [make_seq(f"y{i}", 4000, owner="B") for i in range(2)])
    add_all(sched, [make_seq("z", 4000, owner="C")])
    totals = {"x": 0, "y": 0, "z": 0}
    for _ in range(15):  # 7,680 tokens: every owner stays backlogged
        for rid, n in step(sched).items():
            totals[rid[0]] += n
    assert sum(totals.values()) == 15 * 512
    for owner, total in totals.items():
        assert abs(total - 15 * 512 / 3) <= 15, f"owner of {owner}*: {total} of {15 * 512} tokens"


def test_many_owners_take_turns_in_whole_chunks() -> None:
    """32 clients, a 128-token prompt each, 512 tokens a step: about four whole prompts a step, so
    first tokens come from the first step on (thin equal slices gave every client its first token
    at once, in the ninth step); over a longer run every client gets the same service."""
    sched = make_scheduler()
    seqs = add_all(sched, [make_seq(f"s{i:02d}", 128, owner=f"client{i}", max_tokens=64) for i in range(32)])
    first_token_step = {}
    for n in range(1, 12):
        step(sched)
        for seq in seqs:
            if seq.num_output_tokens and seq.request_id not in first_token_step:
                first_token_step[seq.request_id] = n
    steps = sorted(first_token_step.values())
    assert len(steps) == 32 and steps[:4] == [1] * 4 and steps[15] <= 5 and steps[-1] <= 10, steps

    sched = make_scheduler(max_batched_tokens=256)
    add_all(sched, [make_seq(f"t{i}", 4000, owner=f"client{i}") for i in range(8)])
    totals: dict[str, int] = {}
    for _ in range(32):  # 8,192 tokens: two owners a step, each in turn
        for rid, n in step(sched).items():
            assert n == 128, f"a chunk of {n} tokens"
            totals[rid] = totals.get(rid, 0) + n
    assert sorted(totals.values()) == [1024] * 8, totals


def test_waiting_request_that_does_not_fit_does_not_block_smaller_ones() -> None:
    sched = make_scheduler(num_blocks=20)  # 320 tokens
    holder = add_all(sched, [make_seq("holder", 200, max_tokens=10)])[0]  # 13 blocks, then 14
    step(sched)
    big, small = add_all(sched, [make_seq("big", 150, max_tokens=4), make_seq("small", 20, max_tokens=4)])
    got = step(sched)
    assert "big" not in got and got["small"] == 20, "the small one passes the big one that does not fit"
    assert big.status is SequenceStatus.WAITING and sched.waiting == [big]
    finished_at = {}
    for i in range(40):
        step(sched)
        for seq in (holder, big, small):
            if seq.is_finished:
                finished_at.setdefault(seq.request_id, i)
    assert set(finished_at) == {"holder", "big", "small"}, "the big one got in once blocks were free"
    assert finished_at["small"] < finished_at["holder"] < finished_at["big"]
    assert sched.num_preemptions == 0 and sched.kv.pool.num_free_blocks == 20


def test_request_skipped_for_lack_of_room_is_not_starved() -> None:
    # 8 slots and 24 blocks; a small request arrives every step and holds 2 blocks for ~11 steps:
    # with 7 of them running the big one's 11 blocks do not fit, and a new small one always does.
    sched = make_scheduler(num_blocks=24, max_num_seqs=8, max_batched_tokens=256)
    add_all(sched, [make_seq(f"s{i}", 16, owner="B", max_tokens=10 + i) for i in range(8)])
    step(sched)
    big = add_all(sched, [make_seq("big", 170, owner="A")])[0]
    passed_big = 0
    for i in range(60):
        add_all(sched, [make_seq(f"n{i}", 16, owner="B", max_tokens=10)])
        got = step(sched)
        if big.status is not SequenceStatus.WAITING:
            break
        passed_big += sum(1 for rid, n in got.items() if rid.startswith("n") and n == 16)
    else:
        pytest.fail("the big request starved")
    assert passed_big >= 1, "smaller requests went in while the big one did not fit"
    assert passed_big <= 8 + 1, "after max_num_seqs admissions past it, the big one holds its place"
    assert got["big"] == 170


def test_priority_orders_admission() -> None:
    sched = make_scheduler(max_num_seqs=1)
    add_all(sched, [make_seq("running", 10, max_tokens=3)])
    step(sched)
    low, high = add_all(sched, [make_seq("low", 10, owner="A"), make_seq("high", 10, owner="B", priority=1)])
    order = []
    for _ in range(12):
        got = step(sched)
        order += [rid for rid in ("low", "high") if got.get(rid) == 10]
    assert order == ["high", "low"]


def test_higher_priority_prompt_takes_the_budget_first() -> None:
    sched = make_scheduler()
    add_all(sched, [make_seq("batch", 3000, owner="A")])
    step(sched)
    add_all(sched, [make_seq("interactive", 3000, owner="B", priority=1)])
    assert step(sched) == {"interactive": 512}
    add_all(sched, [make_seq("urgent-short", 8, owner="A", priority=2)])
    assert step(sched) == {"urgent-short": 8, "interactive": 504}


@pytest.mark.parametrize("case", ["owner holding most blocks", "lowest priority"])
def test_preemption_takes_from_the_biggest_owner_or_lowest_priority(case: str) -> None:
    # 10 blocks of 4: the two requests hold 6 + 2 blocks after their prompts, and 9 + 5 at the end.
    sched = make_scheduler(num_blocks=10, block_size=4, max_batched_tokens=64)
    if case == "owner holding most blocks":
        older = add_all(sched, [make_seq("big", 21, owner="A", max_tokens=12)])[0]
        step(sched)
        newer = add_all(sched, [make_seq("small", 7, owner="B", max_tokens=12)])[0]
        victim, survivor = older, newer
    else:
        older = add_all(sched, [make_seq("small", 7, owner="B", max_tokens=12)])[0]
        step(sched)
        newer = add_all(sched, [make_seq("big", 21, owner="A", priority=1, max_tokens=12)])[0]
        victim, survivor = older, newer
    for _ in range(12):
        if sched.num_preemptions:
            break
        step(sched)
    assert sched.num_preemptions == 1
    assert victim.num_preemptions >= 1 and survivor.num_preemptions == 0
    for _ in range(200):
        if not sched.has_unfinished():
            break
        step(sched)
    assert older.num_output_tokens == newer.num_output_tokens == 12
    assert sched.kv.pool.num_free_blocks == 10


def test_long_prompts_that_do_not_all_fit_are_not_thrashed() -> None:
    # 16 blocks of 16 hold one 150-token prompt (10 blocks) and its output, not two: the others
    # wait instead of being computed chunk by chunk and preempted when the pool runs dry.
    sched = make_scheduler(num_blocks=16, max_batched_tokens=64)
    seqs = add_all(sched, [make_seq(f"p{i}", 150, max_tokens=8) for i in range(3)])
    for _ in range(40):
        if not sched.has_unfinished():
            break
        step(sched)
    assert all(seq.is_finished for seq in seqs)
    assert sched.num_preemptions == 0


class FakeClock:
    """Stands in for the scheduler's ``time`` module: a step takes what the cost model says."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_steps_are_paced_to_their_time_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    import llmd.daemon.engine.scheduler as scheduler_module

    clock = FakeClock()
    monkeypatch.setattr(scheduler_module, "time", clock)

    def timed_step(sched: Scheduler) -> float:
        batch = sched.schedule()
        seconds = 0.02 + 0.005 * batch.num_tokens  # a CPU at a long context: 512 tokens take 2.6 s
        clock.now += seconds
        sampled = [7 if seq.num_computed_tokens + n == seq.num_tokens else None
                   for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        sched.update(batch, sampled)
        end_finished(sched, batch)
        return seconds

    sched = make_scheduler(paced=True)  # step_seconds 0.2, lone_step_seconds 1.0
    add_all(sched, [make_seq(f"a{i}", 7000, owner="A", max_tokens=16) for i in range(2)])
    lone = [timed_step(sched) for _ in range(4)]
    assert lone[0] == 0.02 + 0.005 * 64, "nothing measured yet: a probe's tokens, not the whole budget"
    assert all(0.9 <= t <= 1.1 for t in lone[1:]), f"one owner: steps of {lone}"
    short = add_all(sched, [make_seq("b", 4, owner="B", max_tokens=8)])[0]
    arrived = clock.now
    shared = []
    while not short.is_finished and len(shared) < 50:
        shared.append(timed_step(sched))
    assert len(shared) == 8
    assert all(t <= 0.22 for t in shared[1:]), f"two owners: steps of {shared}"
    assert clock.now - arrived <= 8 * 0.22
    assert 0.85 <= timed_step(sched) <= 1.1, "one owner again (the rate last measured in short steps: a little under)"


def test_drafts_stay_within_a_paced_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculation never delays another client's first token: in a step with prompt work under a
    time target, draft tokens take only what the paced budget leaves, as prompt tokens would (the
    unpaced token budget would let them stretch the step past its target); in a step without prompt
    work they take the whole budget. Canary: with drafts counted against the unpaced budget alone, the
    shared steps here took 0.6 s, and the rate measured over them cut the prompt to 16 tokens a step
    (188 steps to its first token, against the ~86 asserted)."""
    import llmd.daemon.engine.scheduler as scheduler_module

    clock = FakeClock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    sched = make_scheduler(paced=True)  # step_seconds 0.2, lone_step_seconds 1.0

    def timed_step(drafts: int) -> tuple[float, int]:
        """A step after giving the chat ``drafts`` draft tokens, all rejected; returns its time
        and the draft tokens it verified."""
        if chat.num_computed_tokens == chat.num_tokens - 1:
            chat.add_drafts([7] * drafts)
        batch = sched.schedule()
        verified = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_draft_tokens:
                verified += n - 1
                seq.accept_drafts(0)  # what LLMEngine._accept does with drafts it rejects
                sched.kv.trim(seq)
        seconds = 0.02 + 0.005 * batch.num_tokens
        clock.now += seconds
        # (a verified row's n still counts the drafts it rejected)
        sampled = [7 if seq.num_computed_tokens + min(n, seq.num_tokens - seq.num_computed_tokens) == seq.num_tokens
                   else None for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        sched.update(batch, sampled)
        end_finished(sched, batch)
        return seconds, verified

    chat = add_all(sched, [make_seq("chat", 16, owner="A", max_tokens=400)])[0]
    while chat.num_output_tokens < 2:
        timed_step(0)
    alone = [timed_step(100) for _ in range(3)]
    assert all(verified == 100 for _, verified in alone), f"no prompt work: drafts take the budget, {alone}"
    doc = add_all(sched, [make_seq("doc", 3000, owner="B", max_tokens=2)])[0]
    shared = []
    while doc.num_output_tokens == 0 and len(shared) < 400:
        shared.append(timed_step(100))
    assert all(t <= 0.22 for t, _ in shared[1:]), f"prompt work of another owner: steps up to {max(shared)}"
    # ~35 prompt tokens a 0.2 s step beside the chat's row: the same first token as without drafts
    assert len(shared) <= 3000 // 33, f"the prompt took {len(shared)} steps"
    after = [timed_step(100)[1] for _ in range(3)]
    assert after == [100] * 3, f"the prompt done, drafts take the budget again: {after}"


def two_decoding(num_blocks: int) -> tuple[Scheduler, Sequence, Sequence]:
    """Two requests past their prompts in a pool of ``num_blocks`` blocks of 4 tokens, 2 blocks each:
    a's next token (position 7) fits its second block, its drafts (from position 8) need a third;
    b's next token (position 8) needs a third."""
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_batched_tokens=64)
    a, b = add_all(sched, [make_seq("a", 7, owner="A", max_tokens=20), make_seq("b", 8, owner="B", max_tokens=20)])
    assert step(sched) == {"a": 7, "b": 8}
    return sched, a, b


def test_drafts_never_take_the_block_another_sequence_needs() -> None:
    """One sequence's drafts get blocks only after every running sequence has one for its own token:
    with one block left, which b's next token needs, a's three drafts go unverified and nothing is
    preempted. Canary: when draft slots were allocated with the sequences' own ones, a's drafts took
    that block and b's token then preempted a, which recomputed its whole context."""
    sched, a, b = two_decoding(num_blocks=5)
    a.add_drafts([1, 2, 3])
    batch = sched.schedule()
    assert sched.num_preemptions == 0
    assert {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens)} == {"a": 1, "b": 1}
    assert a.num_draft_tokens == 0 and len(a.block_ids) == 2 and len(b.block_ids) == 3
    assert sched.kv.pool.num_free_blocks == 0


def test_drafts_do_not_keep_a_waiting_prompt_out() -> None:
    """A waiting prompt that fits beside the running sequences' own tokens is admitted, however many
    drafts they carry (which get what is left: none here). Canary: with draft slots allocated before
    admission, a's drafts took a block of the two c needs, and c waited while a verified them."""
    sched, a, b = two_decoding(num_blocks=7)  # a 2, b 3 with its token: 2 left, c's 8 tokens need 2
    c = add_all(sched, [make_seq("c", 8, owner="C")])[0]
    a.add_drafts([1, 2, 3])
    batch = sched.schedule()
    assert {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens)} == {"a": 1, "b": 1, "c": 8}
    assert sched.num_preemptions == 0 and a.num_draft_tokens == 0 and c.status is SequenceStatus.RUNNING


def test_drafts_take_the_blocks_that_are_left() -> None:
    """With blocks to spare, drafts are verified, as many as fit: one free block beside b's takes a's
    drafts at positions 8-11 (4 of 7); two take all 7."""
    for num_blocks, kept in ((6, 4), (7, 7)):
        sched, a, b = two_decoding(num_blocks=num_blocks)
        a.add_drafts(list(range(1, 8)))
        batch = sched.schedule()
        grants = {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens)}
        assert grants == {"a": 1 + kept, "b": 1} and a.num_draft_tokens == kept, (num_blocks, grants)
        assert sched.num_preemptions == 0 and len(a.block_ids) == -(-(7 + 1 + kept) // 4)


def test_room_for_drafts_is_what_the_step_leaves_them() -> None:
    """The draft model drafts before a step only if the step will have room for drafts: none while a
    prompt that admission will take fills the budget; the whole rest while a prompt waits that does
    not fit the pool (its blocks come back as the running sequences end, which drafts speed up)."""
    sched, a, b = two_decoding(num_blocks=64)  # 59 blocks free once b has its third: slots to spare
    assert sched.room_for_drafts().tokens == 64 - 2
    fits = add_all(sched, [make_seq("c", 8, owner="C")])[0]  # 2 blocks: admitted
    assert sched.room_for_drafts().tokens == 64 - 2 - 8
    long = add_all(sched, [make_seq("d", 300, owner="D")])[0]  # 75 blocks: waits
    assert sched.room_for_drafts().tokens == 64 - 2 - 8
    a.add_drafts([1, 2, 3])
    batch = sched.schedule()
    assert {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens)} == {"a": 4, "b": 1, "c": 8}
    assert fits.status is SequenceStatus.RUNNING and long.status is SequenceStatus.WAITING
    big = make_scheduler(num_blocks=4096, block_size=4, max_batched_tokens=64)
    add_all(big, [make_seq("e", 100, owner="E")])
    assert big.room_for_drafts().tokens == 0  # a prompt that fits and fills the budget


def test_room_for_drafts_is_capped_by_the_slots_drafts_would_get() -> None:
    """Drafts get KV slots last (schedule), so the room counts only the slots left past the
    sequences' own tokens and admission: a's blocks are full at its next token, b's third block
    (which its next token takes) has 3 slots past it, and each free block 4 more; a waiting prompt
    admission takes, its blocks. Each sequence's own room counts its spare slots, not another's: a
    has none, so with the pool dry it has no room. Canary: the room was the token budget's alone
    (62 in every case), so with the pool dry a draft model still ran its passes for drafts that got
    no slots; then, the slots of all counted for each."""
    for num_blocks, room, a_room in ((5, 3, 0), (6, 7, 4), (7, 11, 8)):
        sched, a, b = two_decoding(num_blocks=num_blocks)
        draft_room = sched.room_for_drafts()
        assert (draft_room.tokens, draft_room.for_seq(a), draft_room.for_seq(b)) == (room, a_room, room), num_blocks
        a.add_drafts(list(range(1, 1 + a_room)))
        b.add_drafts([1, 2, 3])
        batch = sched.schedule()
        assert batch.num_tokens - 2 == a_room + 3 and a.num_draft_tokens == a_room and sched.num_preemptions == 0
    sched, a, b = two_decoding(num_blocks=7)
    add_all(sched, [make_seq("c", 8, owner="C")])  # takes the 2 free blocks at admission
    assert sched.room_for_drafts().tokens == 3
    one = make_scheduler(num_blocks=2, block_size=4, max_batched_tokens=64)
    add_all(one, [make_seq("x", 7, max_tokens=20)])
    step(one)  # its next token fills its second block, the last
    assert one.room_for_drafts().tokens == 0


def test_room_for_drafts_counts_a_waiting_prompt_s_prefix_cache_hits() -> None:
    """A waiting prompt whose prefix is cached needs only its other blocks, as admission finds: the
    room leaves it those, and no more than the pool keeps after it. Canary: its blocks were counted
    whole (3), so it seemed not to fit, its last free block was counted for drafts, and admission
    then took it: 7 tokens of room, 3 slots for a's drafts."""
    config = SchedulerConfig(max_num_seqs=8, max_batched_tokens=64, max_model_len=256, step_seconds=None,
                             lone_step_seconds=None)
    sched = Scheduler(config, KVCacheManager(4, 4, prefix_cache=True))
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    a = add_all(sched, [Sequence("a", list(shared), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                 owner="A")])[0]
    assert step(sched) == {"a": 8}  # a holds 3 blocks (its next token starts the third); 1 free
    w = add_all(sched, [Sequence("w", shared + [40, 41], SamplingParams(temperature=0, max_tokens=2,
                                                                         ignore_eos=True), owner="W")])[0]
    room = sched.room_for_drafts()  # w: 2 blocks cached (a's), 1 new: the last free one
    assert (room.tokens, room.for_seq(a)) == (3, 3)
    a.add_drafts([1, 2, 3, 4, 5, 6, 7][:room.for_seq(a)])
    grants = {s.request_id: n for s, n in zip(*(lambda b: (b.seqs, b.num_new_tokens))(sched.schedule()))}
    assert grants == {"a": 4, "w": 2} and w.status is SequenceStatus.RUNNING


@pytest.mark.parametrize("name", ["step_seconds", "lone_step_seconds"])
@pytest.mark.parametrize("bad", [0, -0.5, True, "0.2"])
def test_step_seconds_are_checked(name: str, bad: Any) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a positive number of seconds or None"):
        SchedulerConfig(**{name: bad})
    assert getattr(SchedulerConfig(**{name: None}), name) is None


def test_fair_shares_is_max_min_fair() -> None:
    from llmd.daemon.engine.scheduler import fair_shares

    assert fair_shares({"a": 10, "b": 1000, "c": 1000}, 512) == {"a": 10, "b": 251, "c": 251}
    assert fair_shares({"a": 1000, "b": 1000, "c": 1000}, 512) == {"a": 170, "b": 171, "c": 171}
    assert fair_shares({"a": 3, None: 4}, 512) == {"a": 3, None: 4}
    assert fair_shares({"a": 5, "b": 5}, 0) == {"a": 0, "b": 0}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tiny_models import make_engine, make_hf_model, save_hf_model

    model_dir = save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("fair") / "m", with_tokenizer=True)
    return make_engine(Path(model_dir), num_blocks=32)


def test_add_request_takes_and_checks_a_priority(engine: Any) -> None:
    from llmd.errors import RequestError

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i, bad in enumerate([True, 1.0, "1", 11, -11, None]):
        with pytest.raises(RequestError, match="priority must be an integer from -10 to 10"):
            engine.add_request(f"bad{i}", [1, 2, 3], params, priority=bad)
    assert engine.add_request("chat", [1, 2, 3], params, owner=b"ui", priority=1).priority == 1
    assert engine.add_request("bulk", [4, 5, 6], params, priority=-10).priority == -10
    assert engine.add_request("plain", [7, 8, 9], params).priority == 0
    while engine.has_unfinished():
        engine.step()
