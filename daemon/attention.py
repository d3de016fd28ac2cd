"""The attention backend interface and the batch metadata every backend reads.

The model never sees blocks or sequences: each attention layer hands its new q/k/v and its slice
of the KV cache to the backend together with one :class:`AttentionMetadata` built per step by
whoever drives the model (the simple generator now, the engine's model runner later).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from llmd.kernels import attention_ref


@dataclass(slots=True)
class AttentionMetadata:
    """One step's flat ragged batch, as attention needs it.

    Attributes:
        slot_mapping: ``[T]`` cache slot of every new token.
        query_lens: new tokens per sequence (host list; sums to T).
        seq_lens: total length per sequence after this step (host list).
        block_tables: ``[num_seqs, max_blocks]`` physical block ids.
    """

    slot_mapping: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


class AttentionBackend(Protocol):
    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Write key/value into the cache, then attend. Shapes: q ``[T, H, D]``, k/v ``[T, KVH, D]``."""
        ...


class TorchAttentionBackend:
    """The reference backend: correct everywhere, fast nowhere."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        attention_ref.write_kv(k_cache, v_cache, key, value, meta.slot_mapping)
        return attention_ref.paged_attention(
            query, k_cache, v_cache, meta.query_lens, meta.seq_lens, meta.block_tables, scale,
            sliding_window,
        )
