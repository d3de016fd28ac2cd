"""One-sequence generation over a contiguous KV cache.

This is the simplest driver of the model: one sequence, its whole cache in a single "block", the
same attention path the paged engine uses. The engine (daemon/engine) replaces it for serving; it
stays as the unpaged reference that equivalence tests compare the engine against.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from llmd.daemon.attention import AttentionMetadata
from llmd.daemon.models import LlamaForCausalLM
from llmd.errors import PromptTooLongError, RequestError


@dataclass(slots=True)
class GenerateOptions:
    """Sampling options for :class:`Generator`. Raises :class:`RequestError` on bad values."""

    max_tokens: int = 256
    temperature: float = 0.7
    top_k: int = 40  # 0: no limit
    top_p: float = 0.9  # 1.0: no limit
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")


class Generator:
    """Greedy or temperature sampling for one prompt at a time."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.config = model.config
        self.device = model.model.embed_tokens.weight.device

    def _new_cache(self, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (1, num_tokens, self.config.num_kv_heads, self.config.head_dim)
        return [(torch.empty(shape, dtype=self.model.dtype, device=self.device),
                 torch.empty(shape, dtype=self.model.dtype, device=self.device))
                for _ in range(self.config.num_layers)]

    def _forward(self, token_ids: list[int], start: int, cache: list) -> torch.Tensor:
        positions = torch.arange(start, start + len(token_ids), device=self.device)
        meta = AttentionMetadata(
            slot_mapping=positions, query_lens=[len(token_ids)], seq_lens=[start + len(token_ids)],
            block_tables=torch.zeros(1, 1, dtype=torch.long, device=self.device),
        )
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return self.model(ids, positions, cache, meta)

    def _check_length(self, num_tokens: int) -> None:
        limit = self.config.max_position_embeddings
        if num_tokens > limit:
            raise PromptTooLongError(
                f"prompt plus max_tokens is {num_tokens} tokens but the model's context is {limit}; "
                "shorten the prompt or lower --max-tokens"
            )

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits ``[len(token_ids), vocab]`` for every position of one prompt (no sampling)."""
        if not token_ids:
            raise RequestError("the prompt is empty")
        self._check_length(len(token_ids))
        cache = self._new_cache(len(token_ids))
        return self.model.compute_logits(self._forward(token_ids, 0, cache))

    def stream(self, prompt_ids: list[int], options: GenerateOptions,
               stop_token_ids: set[int] | frozenset[int] = frozenset()) -> Iterator[int]:
        """Yield generated token ids until ``max_tokens`` or a stop token (which is yielded too).

        Raises:
            RequestError: empty prompt. PromptTooLongError: it does not fit the context.
        """
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        total = len(prompt_ids) + options.max_tokens
        self._check_length(total)
        rng = torch.Generator(device=self.device)
        rng.manual_seed(options.seed if options.seed is not None else torch.seed())
        cache = self._new_cache(total)
        hidden = self._forward(prompt_ids, 0, cache)
        length = len(prompt_ids)
        for i in range(options.max_tokens):
            logits = self.model.compute_logits(hidden[-1:])[0]
            token = _sample(logits, options, rng)
            yield token
            if token in stop_token_ids or i == options.max_tokens - 1:
                return
            hidden = self._forward([token], length, cache)
            length += 1


def _sample(logits: torch.Tensor, options: GenerateOptions, rng: torch.Generator) -> int:
    if options.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / options.temperature
    if 0 < options.top_k < logits.shape[-1]:
        kth = torch.topk(logits, options.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if options.top_p < 1:
        # Keep the smallest set of tokens whose probability reaches top_p (always the top one).
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= options.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=rng))
