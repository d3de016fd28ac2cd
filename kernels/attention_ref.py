"""Torch reference for attention over a paged KV cache.

These are the ground truth for the Triton kernels and the CPU path until faster ones exist. They
favour clarity over speed: one SDPA call per sequence, no fusion.

Cache layout per layer (DESIGN.md): ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and V.
A token's *slot* is ``block_id * block_size + offset``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's K and V in its slot.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        key, value: ``[T, num_kv_heads, head_dim]``.
        slot_mapping: ``[T]`` int64 slot per token.
    """
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_context(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Return the first ``length`` cached tokens of one sequence as ``[length, heads, dim]``."""
    return cache.index_select(0, block_ids).flatten(0, 1)[:length]


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention for a ragged batch whose context lives in paged blocks.

    Sequence ``i`` contributes ``query_lens[i]`` consecutive rows of ``query``: its newest tokens,
    at positions ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``. Their K/V must already be in
    the cache. Decode rows (query length 1), prefill chunks and prefix-cache hits are all the same
    case here.

    Args:
        query: ``[T, num_heads, head_dim]`` with ``T == sum(query_lens)``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        query_lens, seq_lens: per-sequence new-token counts and total lengths (host lists, so no
            device sync per layer).
        block_tables: ``[num_seqs, max_blocks]`` int64; only the first ``ceil(seq_len/block_size)``
            entries of a row are read.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: a key is visible only if ``q_pos - k_pos < sliding_window``.

    Returns:
        ``[T, num_heads, head_dim]``.
    """
    block_size = k_cache.shape[1]
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        num_blocks = -(-s_len // block_size)
        block_ids = block_tables[i, :num_blocks]
        k = gather_context(k_cache, block_ids, s_len).to(query.dtype)
        v = gather_context(v_cache, block_ids, s_len).to(query.dtype)
        q = query[start:start + q_len]
        if num_kv_heads != num_heads:
            # NOTE: expand instead of SDPA's enable_gqa: it is supported on every backend and dtype.
            k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
            v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        mask = _causal_mask(q_len, s_len, sliding_window, query.device)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
        )
        out[start:start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def _causal_mask(q_len: int, s_len: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    if window is None and q_len == 1:
        return None  # the newest token sees the whole context
    q_pos = torch.arange(s_len - q_len, s_len, device=device)[:, None]
    k_pos = torch.arange(s_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) < window
    return mask
