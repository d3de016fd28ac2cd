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

from llmd.kernels import ngram_cpu

MIN_NGRAM = 1
MAX_NGRAM = 4
# NOTE: k drafts make a sequence k + 1 rows of the step. The CPU's quantised matmuls take 8 activation
# rows per pass over the weights (kernels/cpu/quant_gemm.c), and a row past a pass costs a second one
# (~3x a row's arithmetic), so a sequence alone drafts at most a pass less its own token (draft_limit),
# and only after a match of 4 or more tokens (DraftLengths). MAX_DRAFT is the limit beside other sequences. On
# `edit` at one stream, drafts of up to 7 after 4-token matches against 3 were ~8% faster with the
# AVX-512 build's rows even with 4-row passes, ~13% with 8-row ones (alternated in process:
# docs/speculative-decoding.md). AVX2's rows cost more: a span of 8 rows alone cost 2.7x one row's whole engine
# step with 8-row passes, 3.6x with the 4-row ones it had before (at which 7 drafts did not pay).
MAX_DRAFT = 3
# A step costs a fixed part F (the weights' unpacking, the step's own overhead), a part A per sequence
# (reading its KV cache: all the rows of a verified span read it once, kernels/cpu/paged_attention.c)
# and a part R per row (its share of the matmuls' and the LM head's arithmetic, its attention's). An
# accepted draft saves what a token costs in the step as it is, (F + B (A + R)) / B for B sequences;
# verifying one costs R. Measured on the default model on the CPU (2 cores, contexts of ~500 tokens,
# alternated in process): a 2-row span alone took 1.2x a 1-row step, and 16 sequences of 2 rows 1.5x
# 16 of 1 (the KV reads are half of such a step, and a span shares them), so R / F ~0.3, A / F ~0.25.
ROW_COST = 0.3
SEQ_COST = 0.25


def draft_cost(num_seqs: int) -> float:
    """What verifying a draft token costs in a step of ``num_seqs`` sequences, in the tokens the
    step makes: ``R B / (F + B (A + R))``, ~0.2 alone, ~0.5 at 16 and at most R / (A + R) (the KV
    reads a verified span shares keep a draft dearer than nothing but cheaper than a token; a cost
    of 0.8 at 16, from rows alone, kept drafts there to one token)."""
    b = max(num_seqs, 1)
    return ROW_COST * b / (1 + b * (SEQ_COST + ROW_COST))


DRAFT_COST = draft_cost(1)


def draft_limit(rows_per_pass: int, num_seqs: int = 1) -> int:
    """The most tokens a sequence drafts in a step of ``num_seqs`` sequences when the model takes
    ``rows_per_pass`` rows per pass over its weights (LlamaForCausalLM.rows_per_pass): its share of
    one pass less its own token, and never fewer than MAX_DRAFT (several sequences fill a pass
    anyway, and drafts of up to 3 were measured to pay there)."""
    if rows_per_pass < 2:
        raise ValueError(f"rows_per_pass must be at least 2, got {rows_per_pass}")
    return max(MAX_DRAFT, min(rows_per_pass, 8) // max(num_seqs, 1) - 1)


SEARCH_WINDOW = 8192  # tokens looked back through: bounds a step's work on a long context
# How far back a match is followed to choose between the occurrences of the last token: the one
# agreeing with the context longest wins (the latest on ties). Replaying the default model's greedy
# answers (20 `edit` chats, 8 questions; up to 7 drafted, benchmarks/ngram_acceptance.py's rules),
# choosing by 8 tokens rather than 4 gave 2.71 tokens a step instead of 2.67 on `edit`, 1.56 instead
# of 1.53 on the questions; 16 gave 2.72, 1.57. (Verifying the two or three best candidates at once,
# as a tree would, gave 2.80 and 2.86: the model's answers copy too little for lookups to give more.)
MATCH_CONTEXT = 8


def lookup(tokens: Sequence[int] | np.ndarray, k: int, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM
           ) -> tuple[list[int], int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest recurring
    suffix of ``tokens`` (followed up to MATCH_CONTEXT tokens back, at least ``min_n``), and that
    suffix's length capped at ``max_n`` (what DraftLengths keys on); ``([], 0)`` when none recurs.
    ``tokens`` may be an int64 array (:class:`TokenHistory`'s), which saves converting a list.

    The longest match first: a long context predicts better than a one-token one, and picks the
    copy of a repeated line that is being copied. The most recent on ties: in an edit, the part of
    the prompt being copied is the one just matched.
    """
    if k <= 0:
        return [], 0
    arr = tokens[-SEARCH_WINDOW:]
    if not isinstance(arr, np.ndarray) or arr.dtype != np.int64 or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr, dtype=np.int64)
    if len(arr) < 2:
        return [], 0
    end, n = ngram_cpu.match(arr, MATCH_CONTEXT) if ngram_cpu.usable() else match_numpy(arr, MATCH_CONTEXT)
    if end < 0 or n < min_n:
        return [], 0
    return arr[end + 1:end + 1 + k].tolist(), min(n, max_n)


def match_numpy(arr: np.ndarray, context: int) -> tuple[int, int]:
    """What ``llmd.kernels.ngram_cpu.match`` computes, in numpy (without the native library):
    ``(end, length)`` of the latest of the longest agreeing occurrences of the last token, or
    ``(-1, 0)``.

    Every match ends where the last token recurs (before the last position, so a token follows it),
    and agrees with the context for as many tokens back as the tokens before that end and before the
    last one are equal: one pass finds the ends, one compare of the ``context - 1`` tokens before
    each their agreement."""
    length = len(arr)
    ends = np.flatnonzero(arr[:length - 1] == arr[length - 1])
    if len(ends) == 0:
        return -1, 0
    depth = min(context, length - 1) - 1  # tokens compared before the last
    if depth <= 0:
        return int(ends[-1]), 1
    backs = np.arange(1, depth + 1)
    before = ends[:, None] - backs  # [ends, depth]: the positions each end is followed back to
    agree = (arr[np.maximum(before, 0)] == arr[length - 1 - backs]) & (before >= 0)
    # how far back each end agrees without a break (argmin: the first False; none: all of depth)
    run = np.where(agree.all(axis=1), depth, agree.argmin(axis=1))
    best = int(run.max())
    return int(ends[np.flatnonzero(run == best)[-1]]), 1 + best  # the latest of the longest


class TokenHistory:
    """A sequence's tokens as an int64 array for :func:`lookup`, grown in place as they come: a list
    converted whole every step cost as much as the lookup itself at a few hundred tokens.

    :meth:`view` takes the tokens as they stand when drafting (no drafts among them: those are the
    engine's until verified), and copies only those added since the last call. A sequence's tokens
    only ever grow between drafts; should they have changed otherwise (shorter, or a different last
    token), the array is built again.
    """

    def __init__(self) -> None:
        self._array = np.empty(0, dtype=np.int64)
        self._length = 0

    def view(self, tokens: Sequence[int]) -> np.ndarray:
        """``tokens`` as an array (a view of this history's buffer, valid until the next call)."""
        n, m = len(tokens), self._length
        if n < m or (m and self._array[m - 1] != tokens[m - 1]):
            m = 0  # not a continuation of what is held: start again
        if n > len(self._array):
            grown = np.empty(max(n, 2 * len(self._array), 256), dtype=np.int64)
            grown[:m] = self._array[:m]
            self._array = grown
        if n > m:
            self._array[m:n] = tokens[m:n]
        self._length = n
        return self._array[:n]


class DraftLength:
    """How many tokens to draft for one sequence, from its recent acceptance.

    ``p``, the chance that a draft token is accepted given that the ones before it were, is an
    exponential average of each verification's accepted / tried tokens (a draft rejected at its
    (n+1)-th token tried n + 1 and accepted n). The k-th draft token is kept only while ``p ** k``,
    the chance it is accepted at all, exceeds ``cost``, what verifying it costs as a share of a
    step. With none worth it, it drafts nothing but probes with one token every ``probe_every``
    steps, so a sequence whose output starts repeating is noticed.
    """

    def __init__(self, max_draft: int = MAX_DRAFT, cost: float = DRAFT_COST, alpha: float = 0.3,
                 probe_every: int = 32) -> None:
        if not 1 <= max_draft <= 64:
            raise ValueError(f"max_draft must be 1 to 64, got {max_draft}")
        if not 0 < cost < 1:
            raise ValueError(f"cost must be in (0, 1), got {cost}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.max_draft, self.cost, self.alpha, self.probe_every = max_draft, cost, alpha, probe_every
        # A new sequence tries a full draft of 3 alone or in a step of 16 (0.9^3 > 0.5); five misses
        # in a row bring it to nothing alone, two at 16 (drafts that always fail cost ~9 draft tokens
        # alone, then a probe every probe_every steps)
        self.p = 0.9
        self._idle_steps = 0

    def worth_drafting(self, cost: float | None = None) -> bool:
        """Whether a draft token is worth verifying at ``cost`` (not counting probes)."""
        return self.p > (self.cost if cost is None else cost)

    def next(self, cost: float | None = None) -> int:
        """The draft length for this step; ``cost``: this step's cost of a draft token, if not
        ``self.cost`` (:func:`draft_cost`)."""
        cost = self.cost if cost is None else cost
        k, chance = 0, self.p
        while k < self.max_draft and chance > cost:
            k, chance = k + 1, chance * self.p
        if k > 0:
            self._idle_steps = 0
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
        tried = accepted + (accepted < proposed)
        self.p += self.alpha * (accepted / tried - self.p)


def accepted_prefix(draft: Sequence[int], target: Sequence[int]) -> int:
    """How many of ``draft``'s tokens a greedy verification keeps: the longest prefix equal to the
    target's own choices at those positions."""
    n = 0
    for d, t in zip(draft, target):
        if d != t:
            break
        n += 1
    return n


class DraftLengths:
    """How many of a prompt-lookup draft's tokens to verify, by the length of the suffix it was found
    by (as :func:`lookup` reports it: capped at MAX_NGRAM, so "a 4-token match" below is one of 4 to
    MATCH_CONTEXT tokens): one :class:`DraftLength` for each.

    A long match is a better guess than a short one: in an edit, a 4-token match is the output
    copying the prompt again, while 1-token matches keep failing inside the changed part. With one
    acceptance for all, those failures silenced the good drafts too: half of an edit's steps drafted
    nothing while its output was copying (benchmarks/ngram_acceptance.py replays it).

    Drafts longer than MAX_DRAFT come only from the longest matches: the output copying its prompt
    keeps copying for a while, where a shorter match's draft soon goes wrong (on `edit` at one
    stream, drafts of up to 7 from 4-token matches alone ran 1.13x of 3, from every match 1.07x;
    measured while lookup followed matches 4 tokens back).

    The draft has to be looked up before its length is known (~0.07 ms inside a served step, natively), so
    :meth:`wanted` says when to look: while some match length is worth verifying, and then every
    ``probe_every`` steps (a one-token probe), as :class:`DraftLength` probes.
    """

    def __init__(self, max_draft: int = MAX_DRAFT, cost: float = DRAFT_COST, probe_every: int = 32) -> None:
        self.max_draft, self.probe_every = max_draft, probe_every
        self._by_match = [DraftLength(max_draft if n == MAX_NGRAM else min(max_draft, MAX_DRAFT), cost,
                                      probe_every=probe_every) for n in range(MAX_NGRAM + 1)]
        self._match = 0  # the suffix length of the draft being verified, which update() credits
        self._idle_steps = 0
        self._probe = False

    def wanted(self, cost: float | None = None) -> bool:
        """Whether to look a draft up this step (``cost`` as in :meth:`DraftLength.next`)."""
        if any(d.worth_drafting(cost) for d in self._by_match[MIN_NGRAM:]):
            self._idle_steps, self._probe = 0, False
            return True
        self._idle_steps += 1
        self._probe = self._idle_steps >= self.probe_every
        if self._probe:
            self._idle_steps = 0
        return self._probe

    def next(self, match: int, cost: float | None = None) -> int:
        """The draft length for this step, for a draft found by a suffix of ``match`` tokens (0:
        none found); ``cost`` as in :meth:`DraftLength.next`."""
        if not 0 <= match <= MAX_NGRAM:
            raise ValueError(f"match must be 0 to {MAX_NGRAM}, got {match}")
        self._match = match
        k = self._by_match[match].next(cost) if match else 0
        if match and self._probe:
            k = max(k, 1)
        self._probe = False
        return k

    def update(self, proposed: int, accepted: int) -> None:
        """After a verification of the draft the last :meth:`next` sized (DraftLength.update)."""
        self._by_match[self._match].update(proposed, accepted)
