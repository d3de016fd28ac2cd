"""The token counts the sampler's penalties read, kept on the device per request.

Rebuilt each step from the requests' token lists, they cost host work and a host-to-device copy
that grow with the text (a 4,000-token answer: 4,000 indices a step for that row, its prompt's too
for the repetition penalty). Here a request's row is built once, from its prompt, and then told
only its new tokens: a step scatters the whole batch's new tokens in one launch, and gathers its
rows in one more (issue 19: nothing in a decode step should scale with the history on the host).
"""

from __future__ import annotations

import torch

from llmd.daemon.device import host_tensor
from llmd.daemon.engine.sampling_params import SamplingParams


def uses_counts(params: SamplingParams) -> bool:
    """Whether a request's sampling reads its token counts (any of the three penalties)."""
    return params.repetition_penalty != 1 or bool(params.presence_penalty) or bool(params.frequency_penalty)


class PenaltyCounts:
    """Per request (by key): ``counts``, how often each token occurs in its output, and ``seen``,
    whether it occurs in its prompt or output; rows of two ``[capacity, vocab]`` device tensors.
    Row 0 stays empty: a batch row without penalties reads it."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self._rows: dict[str, list[int]] = {}  # key -> [row, output tokens counted so far]
        self._free: list[int] = []
        self.counts = torch.zeros(1, vocab, dtype=torch.float32, device=device)
        self.seen = torch.zeros(1, vocab, dtype=torch.bool, device=device)

    def __len__(self) -> int:
        return len(self._rows)

    def release(self, key: str) -> None:
        """Forget a finished request (its row is cleared when it is next handed out)."""
        state = self._rows.pop(key, None)
        if state is not None:
            self._free.append(state[0])

    def _new_row(self) -> int:
        if not self._free:
            capacity = self.counts.shape[0]
            self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
            self.seen = torch.cat([self.seen, torch.zeros_like(self.seen)])
            self._free.extend(range(2 * capacity - 1, capacity - 1, -1))
        row = self._free.pop()
        self.counts[row].zero_()
        self.seen[row].zero_()
        return row

    def gather(self, keys: list[str | None], prompts: list[list[int]],
               outputs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(counts [B, vocab] fp32, seen [B, vocab] bool)`` for a batch whose row ``i`` is the
        request ``keys[i]`` (None: no penalties, an empty row) with the tokens ``prompts[i]`` and
        ``outputs[i]``; tokens not counted yet are counted first. A request's output only grows."""
        vocab = self.vocab
        index: list[int] = []
        count_at: list[int] = []  # flat positions of new output tokens (counts and seen)
        seen_at: list[int] = []  # flat positions of new prompt tokens (seen only)
        for key, prompt, output in zip(keys, prompts, outputs):
            if key is None:
                index.append(0)
                continue
            state = self._rows.get(key)
            if state is None:
                state = self._rows[key] = [self._new_row(), 0]
                seen_at.extend(state[0] * vocab + t for t in set(prompt) if t < vocab)
            row, done = state
            count_at.extend(row * vocab + t for t in output[done:] if t < vocab)
            state[1] = len(output)
            index.append(row)
        if count_at:
            at = host_tensor(count_at, torch.long, self.device)
            self.counts.view(-1).index_add_(0, at, torch.ones(len(count_at), device=self.device))
            self.seen.view(-1)[at] = True
        if seen_at:
            self.seen.view(-1)[host_tensor(seen_at, torch.long, self.device)] = True
        rows = host_tensor(index, torch.long, self.device)
        return self.counts[rows], self.seen[rows]
