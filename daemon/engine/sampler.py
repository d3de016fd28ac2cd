"""Vectorised sampling over a batch with per-request parameters.

Order per row: penalties -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> sample.
Sampling uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)``), which draws from ``p``
exactly. A seeded request's noise for its n-th output token comes from a generator seeded by the
seed and n alone (:func:`position_generator`), so the token drawn there does not depend on what else
is in the batch, nor on how the steps before it ran (chunked, one token at a time, or drafts verified
several at a time: speculative decoding gives a seeded request the very tokens it would have had
without it). The race, not the inverse CDF at one uniform: a draw by cumulative sums moves when the
last bits of any of 49,152 probabilities do, as batching moves them; the race only when two tokens
nearly tie.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmd.daemon.device import host_tensor
from llmd.daemon.engine.penalty_counts import PenaltyCounts, uses_counts
from llmd.daemon.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleRequest:
    """What the sampler needs of one row: its params, its tokens so far (the drafts being verified not
    among them), and the request's id (``key``) where the sampler keeps its penalties' counts between
    steps. (Its noise: keyed by its seed and position when seeded, else torch's default generator.)"""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    key: str | None = None


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    # Per row: None, or (logprob of the sampled token, [(token, logprob)] top-n), from raw logits.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    """NOTE: on a GPU a step reads the device once, for the chosen ids, and once more, for every
    row's log-probabilities together, when any row asks for them: penalties are scattered from one
    index list and greedy and sampled rows race in one argmax, so nothing else waits for the GPU.

    Rows with a ``key`` keep their penalties' token counts on the device between steps
    (llmd.daemon.engine.penalty_counts: only a step's new tokens cross), until :meth:`release`;
    rows without one count their token lists afresh.
    """

    def __init__(self) -> None:
        self._counts: PenaltyCounts | None = None

    def release(self, key: str) -> None:
        """Forget a finished request's counts."""
        if self._counts is not None:
            self._counts.release(key)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRequest], own: torch.Tensor | None = None
                 ) -> SampleResult:
        """Pick one token per row of ``logits`` ``[B, V]`` (fp32). ``own``: the model's logits before
        a grammar masked ``logits`` (structured output), for the log-probabilities."""
        # log-probabilities are the model's own: before grammars, penalties and temperature
        raw = logits if own is None else own
        logits = self._apply_penalties(logits, rows)
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            tokens = argmax_rows(logits)
        else:
            scores = self._race(logits, rows)
            if any(greedy):  # greedy rows race on their logits: the same one argmax picks theirs
                scores = torch.where(host_tensor(greedy, torch.bool, logits.device)[:, None], logits, scores)
            tokens = argmax_rows(scores)
        return SampleResult(tokens, self._logprobs(raw, tokens, rows))

    def _race(self, logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        """``p / E`` per row (temperature, top-k, top-p, min-p applied), whose argmax is a draw."""
        probs = self._probabilities(logits, rows)
        generators = [_generator(r, len(r.output_token_ids), probs.device) for r in rows]
        return probs / exponential_noise(probs, generators)

    def _probabilities(self, logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        """What each row samples from: temperature, top-k, top-p, then min-p (zeroed, not renormalised:
        a race or a ratio does not need it)."""
        device = logits.device
        temperature = host_tensor([1.0 if r.params.greedy else r.params.temperature for r in rows], torch.float32,
                                  device)
        logits = logits / temperature[:, None]
        logits = self._top_k_top_p(logits, rows)
        probs = torch.softmax(logits, dim=-1)
        if any(r.params.min_p > 0 for r in rows):
            min_p = host_tensor([r.params.min_p for r in rows], torch.float32, device)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    def penalised(self, logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        """``logits [B, V]`` with each row's penalties applied (a new tensor where any applies):
        speculative decoding's verification, one row per drafted position."""
        return self._apply_penalties(logits, rows)

    def verify_drafts(self, logits: torch.Tensor, draft: list[int], row: SampleRequest) -> list[int]:
        """Speculative decoding's verification for one sampled row: ``logits`` ``[k + 1, V]`` at the
        row's last token and after each of its ``k`` drafts, with the penalties of each position
        already applied (:meth:`penalised`). Returns the drafts kept and then the row's own next token.

        Each position is sampled as it would be one token at a time, by the race with that position's
        noise; a draft is kept while it is what its position draws, and the first position that draws
        another token gives that token and ends the span. So the output is exactly what sampling one
        token at a time gives with the same noise (a seeded request: the same tokens, with speculation
        or without), and a draft ``d`` is kept with probability ``p(d)``, as rejection sampling keeps a
        deterministic draft (Leviathan et al. 2023). Noise is drawn for the positions reached only.
        """
        k = len(draft)
        probs = self._probabilities(logits, [row] * (k + 1))
        base = len(row.output_token_ids)
        for i in range(k + 1):
            noise = exponential_noise(probs[i:i + 1], [_generator(row, base + i, probs.device)])
            token = argmax_rows(probs[i:i + 1] / noise)[0]
            if i == k or token != draft[i]:
                return draft[:i] + [token]
        raise AssertionError("unreachable: the last position always returns")

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: list[int], rows: list[SampleRequest]
                  ) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """Per row that asked: (logprob of its token, its top-n), all rows read in one copy."""
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not wanted:
            return [None] * len(rows)
        device = raw.device
        picked = raw if len(wanted) == len(rows) else raw[host_tensor(wanted, torch.long, device)]
        logprobs = torch.log_softmax(picked, dim=-1)
        chosen = logprobs.gather(1, host_tensor([tokens[i] for i in wanted], torch.long, device)[:, None])
        n = max(rows[i].params.logprobs for i in wanted)
        values, ids = logprobs.topk(n, dim=-1)
        # ids as floats: exact below 2^24, far above any vocabulary
        read = torch.cat([chosen, values, ids.to(torch.float32)], dim=1).tolist()
        out: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(rows)
        for line, i in zip(read, wanted):
            k = rows[i].params.logprobs
            out[i] = (line[0], [(int(t), v) for t, v in zip(line[1 + n:1 + n + k], line[1:1 + k])])
        return out

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        """Repetition (on every token seen, prompt included), frequency and presence penalties (on
        the output's tokens), for all rows at once."""
        rep = any(r.params.repetition_penalty != 1 for r in rows)
        counted = any(r.params.presence_penalty or r.params.frequency_penalty for r in rows)
        if not rep and not counted:
            return logits
        device = logits.device
        penalised = [uses_counts(r.params) for r in rows]
        if all(r.key is not None for r, p in zip(rows, penalised) if p):
            if self._counts is None or self._counts.vocab != logits.shape[1] or self._counts.device != device:
                self._counts = PenaltyCounts(logits.shape[1], device)
            counts, seen = self._counts.gather([r.key if p else None for r, p in zip(rows, penalised)],
                                               [r.prompt_token_ids for r in rows], [r.output_token_ids for r in rows])
        else:
            counts, seen = _counts_from_lists(rows, penalised, logits.shape[1], device)

        def per_row(values: list[float]) -> torch.Tensor:
            return host_tensor(values, torch.float32, device)[:, None]

        if rep:
            penalty = per_row([r.params.repetition_penalty for r in rows])  # 1 where none: no change
            logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        if counted:
            logits = (logits - per_row([r.params.frequency_penalty for r in rows]) * counts
                      - per_row([r.params.presence_penalty for r in rows]) * (counts > 0).to(logits.dtype))
        return logits

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        vocab = logits.shape[-1]
        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
        top_p = [r.params.top_p for r in rows]
        if all(k == vocab for k in top_k) and all(p >= 1 for p in top_p):
            return logits
        device = logits.device
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        drop = ranks >= host_tensor(top_k, torch.long, device)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the ones before it already reach top_p; the first always stays.
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= before >= host_tensor(top_p, torch.float32, device)[:, None]
        mask = torch.zeros_like(drop).scatter(1, order, drop)
        return logits.masked_fill(mask, float("-inf"))


def _counts_from_lists(rows: list[SampleRequest], penalised: list[bool], vocab: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts, seen)`` as llmd.daemon.engine.penalty_counts keeps them, built from the rows'
    token lists in one scatter each (rows without a key: llmd.daemon.reference_generator, tests)."""
    batch = len(rows)
    count_at = [i * vocab + t for i, (r, p) in enumerate(zip(rows, penalised)) if p
                for t in r.output_token_ids if t < vocab]
    seen_at = [i * vocab + t for i, (r, p) in enumerate(zip(rows, penalised)) if p
               for t in set(r.prompt_token_ids) | set(r.output_token_ids) if t < vocab]
    counts = torch.zeros(batch * vocab, dtype=torch.float32, device=device)
    seen = torch.zeros(batch * vocab, dtype=torch.bool, device=device)
    if count_at:
        index = host_tensor(count_at, torch.long, device)
        counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    if seen_at:
        seen[host_tensor(seen_at, torch.long, device)] = True
    return counts.view(batch, vocab), seen.view(batch, vocab)


def position_generator(seed: int, position: int, device: torch.device | str) -> torch.Generator:
    """The generator of a seeded request's draw for its output token ``position``: seeded by the seed
    and the position alone (splitmix64 of the two), whatever ran before it."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    generator = torch.Generator(device=device)
    # NOTE: below 2**63, as torch takes them; the CPU's mt19937 keeps the low 32 bits (well mixed
    # here), CUDA's Philox all of them
    generator.manual_seed((x ^ (x >> 31)) >> 1)
    return generator


def _generator(row: SampleRequest, position: int, device: torch.device) -> torch.Generator | None:
    seed = row.params.seed
    return None if seed is None else position_generator(seed, position, device)


def exponential_noise(like: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """``Exp(1)`` noise shaped as ``like`` ``[B, V]``, row i from ``generators[i]`` (None: torch's
    default), as ``-log(U)``. NOTE: torch 2.13's CPU ``exponential_`` takes ~1 ms for a row of
    49,152 (a third of a 16-stream step); ``uniform_`` and a log, ~0.2 ms."""
    noise = torch.empty_like(like)
    for i, generator in enumerate(generators):
        noise[i].uniform_(generator=generator)
    return noise.log_().neg_()  # U = 0 gives inf: that token cannot win, as p / E with E -> inf


def argmax_rows(x: torch.Tensor) -> list[int]:
    """The index of each row's largest value (the first of ties), as a host list. NOTE: on the CPU
    through numpy: torch 2.13's CPU argmax takes ~70 us for one row of 49,152 logits and ~1 ms for
    16 rows, numpy's ~6 and ~90."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return x.contiguous().numpy().argmax(axis=-1).tolist()
    return x.argmax(dim=-1).tolist()


def top_logprobs(row_logprobs: torch.Tensor, token_id: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """``(logprob of token_id, top-n (token, logprob) pairs)`` from one row of log-probabilities."""
    chosen = float(row_logprobs[token_id])
    if n == 0:
        return chosen, []
    values, ids = row_logprobs.topk(n)
    return chosen, list(zip(ids.tolist(), values.tolist()))
