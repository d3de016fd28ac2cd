"""Prompt-lookup drafts (daemon/engine/ngram_proposer.py) against a brute-force reference, through the
native match (kernels/cpu/ngram.c) and its numpy fallback, and the adaptive draft length."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmd.daemon.engine.ngram_proposer import (DRAFT_COST, MATCH_CONTEXT, MAX_DRAFT, ROW_COST, SEQ_COST, DraftLength,
                                               DraftLengths, TokenHistory, accepted_prefix, draft_cost, draft_limit,
                                               lookup)
from llmd.kernels import ngram_cpu


@pytest.fixture(params=["native", "numpy"], autouse=True)
def match_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs through the native match and through the numpy one."""
    if request.param == "native" and not ngram_cpu.usable():
        pytest.skip("the native library is not built (no C compiler)")
    if request.param == "numpy":
        monkeypatch.setattr(ngram_cpu, "usable", lambda: False)
    return request.param


def propose(tokens: list[int], k: int) -> list[int]:
    """The draft :func:`lookup` finds, without its match length."""
    return lookup(tokens, k)[0]


def reference(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> tuple[list[int], int]:
    """Brute force: the longest suffix (up to MATCH_CONTEXT tokens) that occurs earlier with a token
    after it; its latest occurrence's next tokens, and the suffix's length capped at ``max_n``."""
    for n in range(min(MATCH_CONTEXT, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k], min(n, max_n)
    return [], 0


def test_the_longest_and_latest_match() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    # suffix [6, 7] occurs at 1 (then 8) and 6 (then 2): the latest wins
    assert propose(tokens, 3) == [2, 3, 6]
    # the longest suffix that recurs wins over a later shorter one
    assert propose([1, 2, 3, 9, 0, 2, 3, 7, 3], 2) == [7, 3]  # only [3] recurs: its latest, at 6
    assert propose([1, 2, 3, 9, 5, 3, 8, 2, 3], 1) == [9]  # [2, 3] at 1 beats [3] at 5
    assert propose([9, 8, 7], 4) == [] and propose([4], 3) == [] and propose([1, 2, 1, 2], 0) == []
    assert propose([1, 2, 3, 1, 2], 10) == [3, 1, 2]  # up to the end of what follows
    # Past 4 tokens: of two copies of a line, the one agreeing with more of the context is followed,
    # though another came later (a 4-token suffix alone would take the latest), and the match
    # length reported is capped at 4 (DraftLengths' classes)
    line = [7, 1, 2, 3, 4]
    tokens = [8, *line, 5, 9, *line, 6, 8, *line]
    assert lookup(tokens, 1) == ([5], 4)
    assert lookup([9, *line, 6, 8, *line], 1) == ([6], 4)  # one copy: the plain latest


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(0, 6))
def test_matches_the_brute_force_reference(tokens: list[int], k: int) -> None:
    want = reference(tokens, k) if k > 0 else ([], 0)
    assert lookup(tokens, k) == want and propose(tokens, k) == want[0]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=12), st.integers(1, 5), st.integers(0, 6),
       st.integers(1, 10), st.integers(1, 10))
def test_long_matches_and_bounds_match_the_reference(line: list[int], copies: int, k: int, min_n: int,
                                                    max_n: int) -> None:
    # A line repeated (what an edit's output does): matches longer than MATCH_CONTEXT, and every
    # min_n and max_n on either side of it
    tokens = (line * copies)[:-1] if copies > 1 else line
    want = reference(tokens, k, min_n, max_n) if k > 0 else ([], 0)
    assert lookup(tokens, k, min_n, max_n) == want


def test_an_array_and_a_list_find_the_same(match_path: str) -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 80))).tolist()
        assert lookup(np.asarray(tokens, dtype=np.int64), 5) == lookup(tokens, 5)
        assert lookup(np.asarray(tokens, dtype=np.int32), 5) == lookup(tokens, 5)  # converted


def test_the_native_match_refuses_what_it_cannot_read(match_path: str) -> None:
    if match_path != "native":
        pytest.skip("the native match's own checks")
    with pytest.raises(ValueError, match="int64"):
        ngram_cpu.match(np.arange(10, dtype=np.int32), MATCH_CONTEXT)
    with pytest.raises(ValueError, match="contiguous"):
        ngram_cpu.match(np.arange(20, dtype=np.int64)[::2], MATCH_CONTEXT)


def test_the_token_history_follows_its_sequence() -> None:
    """Tokens added are copied in; a sequence that is not the one held (shorter, or another last
    token) is taken whole; the view is always the tokens as given."""
    history = TokenHistory()
    tokens = list(range(5))
    assert history.view(tokens).tolist() == tokens
    for t in range(300):  # grown past its first buffer, a few tokens at a time
        tokens += [t % 7] * (1 + t % 3)
        assert history.view(tokens).tolist() == tokens
    assert history.view(tokens[:100]).tolist() == tokens[:100]  # shorter: rebuilt
    other = tokens[:99] + [12345]
    assert history.view(other).tolist() == other  # same length, another last token
    assert history.view(other + [1, 2]).tolist() == other + [1, 2]
    assert history.view([]).tolist() == []


def test_draft_lengths_are_learned_per_match_length() -> None:
    """Drafts found by 1-token suffixes that keep failing silence those matches only: drafts found
    by 4-token suffixes, which keep being right, are still verified in full (one acceptance for all
    silenced both, and half of an edit's steps drafted nothing)."""
    lengths = DraftLengths(max_draft=3, cost=0.2)
    assert lengths.next(4) == 3 and lengths.next(1) == 3  # optimistic at first, whatever the match
    assert lengths.next(0) == 0  # nothing found: nothing to verify
    for _ in range(8):
        for _ in range(3):
            if lengths.next(1):
                lengths.update(1, 0)  # short matches fail
        assert lengths.next(4) == 3
        lengths.update(3, 3)  # long ones are right
    assert lengths.next(1) == 0 and lengths.next(4) == 3
    single = DraftLength(max_draft=3, cost=0.2)  # the same history through one acceptance
    for _ in range(8):
        for _ in range(3):
            single.update(1, 0)
        single.update(3, 3)
    assert single.next() == 1  # p ~0.4: only the first token is worth verifying
    with pytest.raises(ValueError):
        lengths.next(5)


def test_a_request_whose_drafts_all_fail_looks_only_to_probe() -> None:
    """Looking a draft up costs ~40-65 us a step: once no match length is worth verifying, it is done
    only every probe_every steps, for a one-token probe; a probe that is right brings drafting back."""
    lengths = DraftLengths(max_draft=3, cost=0.2, probe_every=5)
    for match in range(1, 5):
        for _ in range(6):
            if lengths.wanted() and lengths.next(match):
                lengths.update(1, 0)
    looks = [lengths.wanted() for _ in range(15)]
    probes = [i for i, look in enumerate(looks) if look]
    assert len(probes) == 3 and probes[1] - probes[0] == probes[2] - probes[1] == 5
    while not lengths.wanted():
        pass
    assert lengths.next(3) == 1  # the probe
    for _ in range(4):
        lengths.update(1, 1)
        assert lengths.wanted()
        lengths.next(3)
    assert lengths.next(3) == 3 and lengths.next(1) == 0


def test_draft_length_follows_acceptance() -> None:
    d = DraftLength(max_draft=5, cost=0.2, alpha=0.5, probe_every=4)
    assert d.next() == 5  # optimistic at first
    d.update(5, 5)
    assert d.next() == 5
    for _ in range(6):  # drafts keep failing: down to nothing
        d.update(d.next() or 1, 0)
    lengths = [d.next() for _ in range(12)]
    probes = [i for i, k in enumerate(lengths) if k]
    assert set(lengths) == {0, 1} and len(probes) == 3 and probes[1] - probes[0] == probes[2] - probes[1] == 4
    for _ in range(4):  # the output starts repeating: back up
        d.update(1, 1)
    assert d.next() >= 4
    for _ in range(12):  # one of every two draft tokens kept: p -> 1/2, and 1/4 > cost > 1/8 gives two
        d.update(d.next(), 1)
    assert abs(d.p - 0.5) < 0.05 and d.next() == 2
    assert DraftLength(max_draft=5, cost=0.75).next() == 2  # 0.9, 0.81 > 0.75 > 0.729: a dearer verify drafts less
    d.update(0, 0)  # nothing proposed: nothing learned
    with pytest.raises(ValueError):
        d.update(2, 3)
    with pytest.raises(ValueError):
        DraftLength(max_draft=0)
    with pytest.raises(ValueError):
        DraftLength(cost=1.5)


def test_accepted_prefix() -> None:
    assert accepted_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert accepted_prefix([1, 2], [1, 2, 9]) == 2 and accepted_prefix([7], [1]) == 0 and accepted_prefix([], [1]) == 0


def test_a_draft_costs_more_in_a_fuller_step() -> None:
    costs = [draft_cost(n) for n in (1, 2, 4, 16, 64)]
    assert abs(costs[0] - DRAFT_COST) < 1e-12 and costs == sorted(costs) and 0 < costs[0]
    # a verified span reads its KV cache once, so a draft never costs what a token does
    assert draft_cost(10**6) < ROW_COST / (ROW_COST + SEQ_COST) < 1
    d = DraftLength()
    d.p = 0.75  # 0.75, 0.56, 0.42 > cost alone (~0.2); 0.75 and 0.56 > cost in a step of 16 (~0.5)
    assert d.next(draft_cost(1)) == MAX_DRAFT == 3 and d.next(draft_cost(16)) == 2
    d.p = 0.6  # 0.6 > ~0.5 > 0.36
    assert d.next(draft_cost(16)) == 1


def test_a_sequence_alone_drafts_up_to_a_pass_of_rows() -> None:
    assert [draft_limit(rows) for rows in (2, 4, 8, 16)] == [MAX_DRAFT, 3, 7, 7]  # at most 8 rows
    assert [draft_limit(8, seqs) for seqs in (1, 2, 3, 16)] == [7, 3, 3, 3]  # beside others, MAX_DRAFT
    with pytest.raises(ValueError):
        draft_limit(1)


def test_only_the_longest_matches_draft_past_max_draft() -> None:
    lengths = DraftLengths(max_draft=7, cost=0.01)  # every length worth verifying
    assert lengths.wanted()
    assert lengths.next(4) == 7  # the output copying its prompt
    assert [lengths.next(n) for n in (1, 2, 3)] == [MAX_DRAFT] * 3
    assert lengths.next(0) == 0  # nothing found
