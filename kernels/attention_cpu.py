"""Decode attention over the paged KV cache in the native CPU library (kernels/cpu/paged_attention.c),
and the writes of prompt chunks' K/V into an int8 cache.

:func:`decode_attention` has the contract of :func:`llmd.kernels.attention_ref.decode_attention`, its
reference: one query row per sequence, the newest token. The cache may be fp32, bf16 or int8
(llmd.kernels.kv_format); the arithmetic is fp32. :func:`write_kv` is the reference's write for int8
caches, bit for bit.
"""

from __future__ import annotations

import ctypes

import torch

from llmd.kernels.decode_cpu import CACHE_DTYPES, CACHE_KINDS
from llmd.kernels.kv_format import head_dim_of
from llmd.kernels.native import library


def decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: list[int] | torch.Tensor,
    block_tables: torch.Tensor, scale: float, sliding_window: int | None = None, lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Attention for a batch of single-token queries.

    Args:
        query: ``[B, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, row]``, fp32, bf16 or int8.
        seq_lens: context length per row (the query token included): a list, or an int32 CPU
            tensor (what AttentionMetadata builds once per step, so no layer rebuilds it).
        block_tables: ``[B, >= max blocks]`` block ids.
        lib: another build of the library (tests).

    Returns:
        ``[B, num_heads, head_dim]`` in the query's dtype.
    """
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the native decode attention reads fp32, bf16 or int8 caches, not {k_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the native decode attention needs contiguous caches")
    batch, num_heads, head_dim = query.shape
    if head_dim_of(k_cache) != head_dim:
        raise ValueError(f"queries of {head_dim} values per head against a cache of {head_dim_of(k_cache)}")
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    q = query.float().contiguous()
    tables = block_tables
    if tables.dtype != torch.int64 or not tables.is_contiguous():
        tables = tables.to(torch.int64).contiguous()
    if isinstance(seq_lens, torch.Tensor):
        lens = seq_lens if seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() else seq_lens.to(torch.int32).contiguous()
    else:
        lens = torch.tensor(seq_lens, dtype=torch.int32)
    if lens.shape[0] != batch or tables.shape[0] != batch:
        raise ValueError(f"{batch} query rows but {lens.shape[0]} lengths and {tables.shape[0]} block tables")
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32)
    (lib or library()).llmd_paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), CACHE_KINDS[k_cache.dtype],
        tables.data_ptr(), tables.shape[1], lens.data_ptr(), batch, num_heads, num_kv_heads, head_dim, block_size,
        sliding_window or 0, scale, out.data_ptr(), torch.get_num_threads(),
    )
    return out.to(query.dtype)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, lib: ctypes.CDLL | None = None) -> None:
    """:func:`llmd.kernels.attention_ref.write_kv` for an int8 cache, in the native library: the rows
    quantised as the reference quantises them (bit for bit), in one call per cache instead of a
    dozen torch operations (a prompt chunk's writes, every layer)."""
    if k_cache.dtype != torch.int8 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the native KV write takes contiguous int8 caches")
    tokens, num_kv_heads, head_dim = key.shape
    if head_dim_of(k_cache) != head_dim or k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"rows of {num_kv_heads}x{head_dim} for a cache of "
                         f"{k_cache.shape[2]}x{head_dim_of(k_cache)}")
    slots = slot_mapping if slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() \
        else slot_mapping.to(torch.int64).contiguous()
    native = lib or library()
    for cache, rows in ((k_cache, key), (v_cache, value)):
        rows = rows.float().contiguous()
        native.llmd_kv_write(rows.data_ptr(), slots.data_ptr(), tokens, num_kv_heads, head_dim,
                             CACHE_KINDS[torch.int8], cache.data_ptr(), torch.get_num_threads())
