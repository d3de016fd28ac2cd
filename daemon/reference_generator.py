"""One-sequence generation over a contiguous KV cache.

This is the simplest driver of the model: one sequence, its cache one run of blocks in order (a
token's slot is its position), the same attention path the paged engine uses. The engine
(daemon/engine) replaces it for serving; it stays as the unpaged reference that equivalence tests
compare the engine against.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from llmd.daemon.attention import AttentionMetadata
from llmd.daemon.engine.sampler import SampleRequest, Sampler
from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.models import LlamaForCausalLM
from llmd.errors import PromptTooLongError, RequestError


BLOCK_SIZE = 16  # tokens per KV block of a Generator's cache


class Generator:
    """One prompt at a time, sampled by the engine's :class:`Sampler`."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.config = model.config
        self.device = model.model.embed_tokens.weight.device

    def _new_cache(self, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Blocks of BLOCK_SIZE in order, so a token's slot is its position: what every attention
        # backend takes (Triton's needs 16 or 32 per block; one block of the whole prompt broke
        # INT4 calibration on the GPU path).
        shape = (-(-num_tokens // BLOCK_SIZE), BLOCK_SIZE, self.config.num_kv_heads, self.config.head_dim)
        return [(torch.empty(shape, dtype=self.model.dtype, device=self.device),
                 torch.empty(shape, dtype=self.model.dtype, device=self.device))
                for _ in range(self.config.num_layers)]

    def _forward(self, token_ids: list[int], start: int, cache: list) -> torch.Tensor:
        positions = torch.arange(start, start + len(token_ids), device=self.device)
        meta = AttentionMetadata(
            slot_mapping=positions, query_lens=[len(token_ids)], seq_lens=[start + len(token_ids)],
            block_tables=torch.arange(cache[0][0].shape[0], device=self.device)[None, :],
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

    def step_logits(self, prompt_ids: list[int], new_ids: list[int]) -> torch.Tensor:
        """Logits ``[len(new_ids), vocab]``: after the prompt, then after each of ``new_ids[:-1]``
        fed one decode step at a time (teacher-forced), which is the path the engine's decode steps
        take (:meth:`logits` runs them as one prompt)."""
        if not prompt_ids or not new_ids:
            raise RequestError("the prompt and the new tokens must not be empty")
        self._check_length(len(prompt_ids) + len(new_ids))
        cache = self._new_cache(len(prompt_ids) + len(new_ids))
        hidden = [self._forward(prompt_ids, 0, cache)[-1:]]
        for i, token in enumerate(new_ids[:-1]):
            hidden.append(self._forward([token], len(prompt_ids) + i, cache))
        return self.model.compute_logits(torch.cat(hidden))

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               stop_token_ids: set[int] | frozenset[int] = frozenset()) -> Iterator[int]:
        """Yield generated token ids until ``max_tokens`` or a stop token (which is yielded too).

        Raises:
            RequestError: empty prompt. PromptTooLongError: it does not fit the context.
        """
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        total = len(prompt_ids) + params.max_tokens
        self._check_length(total)
        sampler = Sampler()  # (a seeded request's noise is keyed by its seed and position: sampler.py)
        cache = self._new_cache(total)
        hidden = self._forward(prompt_ids, 0, cache)
        length = len(prompt_ids)
        output: list[int] = []
        for i in range(params.max_tokens):
            logits = self.model.compute_logits(hidden[-1:])
            token = sampler(logits, [SampleRequest(params, prompt_ids, output)]).token_ids[0]
            output.append(token)
            yield token
            if token in stop_token_ids or i == params.max_tokens - 1:
                return
            hidden = self._forward([token], length, cache)
            length += 1

