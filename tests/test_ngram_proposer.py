"""Prompt-lookup drafts (daemon/engine/ngram_proposer.py) against a brute-force reference, and the
adaptive draft length."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmd.daemon.engine.ngram_proposer import DRAFT_COST, MAX_DRAFT, DraftLength, accepted_prefix, draft_cost, propose


def reference(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Brute force: the longest suffix that occurs earlier with a token after it; its latest occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


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


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(0, 6))
def test_matches_the_brute_force_reference(tokens: list[int], k: int) -> None:
    assert propose(tokens, k) == (reference(tokens, k) if k > 0 else [])


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
    assert abs(costs[0] - DRAFT_COST) < 1e-12 and costs == sorted(costs) and 0 < costs[0] and costs[-1] < 1
    d = DraftLength()
    d.p = 0.85  # 0.85, 0.72, 0.61 > cost alone (0.2); only 0.85 > cost in a step of 16 (0.8)
    assert d.next(draft_cost(1)) == MAX_DRAFT == 3 and d.next(draft_cost(16)) == 1
