"""Torch reference for attention over a paged KV cache.

These are the ground truth for the Triton kernels and the CPU path until faster ones exist. They
favour clarity over speed: one SDPA call per sequence, no fusion.

Cache layout per layer (docs/architecture.md): ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and V
(an int8 cache's rows carry their scale: llmd.kernels.kv_format). A token's *slot* is
``block_id * block_size + offset``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmd.kernels.kv_format import as_float, to_cache

# decode(query, k_cache, v_cache, seq_lens, block_tables, scale, sliding_window) -> out
DecodeFn = Callable[..., torch.Tensor]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's K and V in its slot.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, row]`` (kv_format: the head's values,
            int8 ones with their scale).
        key, value: ``[T, num_kv_heads, head_dim]``.
        slot_mapping: ``[T]`` int64 slot per token.
    """
    num_kv_heads, row = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, to_cache(key, k_cache.dtype))
    v_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, to_cache(value, v_cache.dtype))


def gather_context(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Return the first ``length`` cached tokens of one sequence as ``[length, heads, dim]`` (an int8
    cache's dequantised to fp32)."""
    return as_float(cache.index_select(0, block_ids).flatten(0, 1)[:length])


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    decode: DecodeFn | None = None,
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
        decode: computes the decode rows (default :func:`decode_attention`); a faster kernel with
            the same contract plugs in here.

    Returns:
        ``[T, num_heads, head_dim]``.
    """
    block_size = k_cache.shape[1]
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(query)
    starts = [0] * len(query_lens)
    for i in range(1, len(query_lens)):
        starts[i] = starts[i - 1] + query_lens[i - 1]
    decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
    # NOTE: decode rows (one new token each) go through one batched computation instead of one
    # SDPA call per sequence: with many streams the per-call overhead dominated a step.
    if decode_rows:
        token_idx = torch.tensor([starts[i] for i in decode_rows], device=query.device)
        out[token_idx] = (decode or decode_attention)(
            query[token_idx], k_cache, v_cache, [seq_lens[i] for i in decode_rows],
            block_tables[decode_rows], scale, sliding_window,
        )
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        if q_len == 1:
            continue  # done above
        start = starts[i]
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
        # NOTE: 4-D inputs (a batch of one): on the CPU, torch sends 3-D ones to its unfused math
        # path (scores materialised, softmax in the model dtype) and 4-D ones to its flash kernel,
        # 2-3x faster for a 512-token chunk (measured with torch 2.13).
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale
        )
        out[start:start + q_len] = o[0].transpose(0, 1)
    return out


def decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: list[int] | torch.Tensor,
    block_tables: torch.Tensor, scale: float, sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention for a batch of single-token queries, each the newest token of its sequence.

    Args:
        query: ``[B, num_heads, head_dim]``.
        seq_lens: context length per row (the query token included): a list, or the int tensor
            AttentionMetadata builds once per step.
        block_tables: ``[B, >= max blocks]``.

    Returns:
        ``[B, num_heads, head_dim]``.
    """
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = max(seq_lens) if isinstance(seq_lens, list) else int(seq_lens.max())
    num_blocks = -(-max_len // block_size)
    tables = block_tables[:, :num_blocks]
    # [B, L, KVH, D] padded to the longest context; padding is masked below.
    # NOTE: computed in fp32 whatever the cache dtype: on the CPU, bf16 batched matmuls of these
    # small shapes cost several times more than the fp32 ones, and fp32 is also more accurate.
    k = as_float(k_cache[tables].flatten(1, 2)[:, :max_len]).float()
    v = as_float(v_cache[tables].flatten(1, 2)[:, :max_len]).float()
    q = query.view(batch, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("bkgd,blkd->bkgl", q, k) * scale
    lens = torch.as_tensor(seq_lens, device=query.device)
    k_pos = torch.arange(max_len, device=query.device)
    visible = k_pos[None, :] < lens[:, None]
    if sliding_window is not None:
        visible &= k_pos[None, :] > (lens[:, None] - 1 - sliding_window)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Padding slots hold stale data: probability 0 times a stale inf or NaN would still be NaN.
    v = v.masked_fill(~visible[:, :, None, None], 0.0)
    return torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(batch, num_heads, head_dim).to(query.dtype)


def _causal_mask(q_len: int, s_len: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    if window is None and q_len == 1:
        return None  # the newest token sees the whole context
    q_pos = torch.arange(s_len - q_len, s_len, device=device)[:, None]
    k_pos = torch.arange(s_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) < window
    return mask
