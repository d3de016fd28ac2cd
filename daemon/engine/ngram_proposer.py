"""Prompt-lookup drafts for speculative decoding (issue 22): guess a sequence's next tokens by finding
its last few tokens earlier in its own prompt and output, and proposing what followed them there.

Editing code, rewriting or summarising a pasted text, answering about a document: the output repeats
long spans of the prompt, so such guesses are often right and cost no second model. When they keep
failing (ordinary chat), :class:`DraftLength` brings a sequence's draft length to 0, so it pays
nothing but an occasional one-token probe.

The engine (``--speculative ngram``) drafts with these before a step and verifies the drafts in it
(daemon/engine/engine.py: ``_draft``, ``_accept``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MIN_NGRAM = 1
MAX_NGRAM = 4
MAX_DRAFT = 5
SEARCH_WINDOW = 8192  # tokens looked back through: bounds a step's work on a long context


def propose(tokens: Sequence[int] | np.ndarray, k: int, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix of
    ``tokens`` (of ``max_n`` down to ``min_n`` tokens); ``[]`` when no suffix recurs.

    The longest match first: a 4-token context predicts better than a 1-token one. The most recent
    occurrence: in an edit, the part of the prompt being copied is the one just matched.
    """
    if k <= 0:
        return []
    arr = np.asarray(tokens[-SEARCH_WINDOW:], dtype=np.int64)
    length = len(arr)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n:]
        # windows starting at 0 .. length-n-1: each has at least one token after it
        windows = sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


class DraftLength:
    """How many tokens to draft for one sequence, from its recent acceptance.

    An exponential average of the accepted share of each draft sets the length (``max_draft`` when
    drafts are taken whole). Below one token it drafts nothing, but probes with one token every
    ``probe_every`` steps, so a sequence whose output starts repeating is noticed.
    """

    def __init__(self, max_draft: int = MAX_DRAFT, alpha: float = 0.5, probe_every: int = 16) -> None:
        if not 1 <= max_draft <= 64:
            raise ValueError(f"max_draft must be 1 to 64, got {max_draft}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.max_draft, self.alpha, self.probe_every = max_draft, alpha, probe_every
        self.rate = 1.0  # optimistic: a new sequence tries a full draft
        self._idle_steps = 0

    def next(self) -> int:
        """The draft length for this step."""
        k = int(self.rate * self.max_draft + 0.5)
        if k > 0:
            return k
        self._idle_steps += 1
        if self._idle_steps >= self.probe_every:
            self._idle_steps = 0
            return 1
        return 0

    def update(self, proposed: int, accepted: int) -> None:
        """After a verification: ``accepted`` of ``proposed`` draft tokens were the model's own."""
        if proposed <= 0:
            return
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted must be in [0, {proposed}], got {accepted}")
        self.rate += self.alpha * (accepted / proposed - self.rate)


def accepted_prefix(draft: Sequence[int], target: Sequence[int]) -> int:
    """How many of ``draft``'s tokens a greedy verification keeps: the longest prefix equal to the
    target's own choices at those positions."""
    n = 0
    for d, t in zip(draft, target):
        if d != t:
            break
        n += 1
    return n
