"""Triton paged attention: KV-cache writes, decode with split-K, and prefill/extend over paged blocks.

The cache layout is the torch reference's (``attention_ref.py``): per layer, K and V each
``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's slot is
``block_id * block_size + offset``. Three kernels, one job each:

* ``_write_kv_kernel`` stores each new token's K and V in its slot (one program per token;
  a negative slot is skipped, so padded batches need no special case).
* ``_decode_kernel`` attends one new token per sequence (a pure decode step). One program per
  ``(sequence, KV head, split)``: the query heads sharing that KV head are the rows of one tile,
  so each K/V block is read once per KV head, not once per query head (GQA, any ratio). With
  ``num_splits > 1`` the sequence's blocks are divided between programs (flash-decoding) and
  ``_decode_reduce_kernel`` combines their partial results by their log-sum-exp: a long context
  with few sequences still fills the GPU.
* ``_extend_kernel`` attends a ragged batch of chunks: sequence ``i`` brings ``query_len`` new
  tokens at positions ``seq_len - query_len .. seq_len - 1`` whose K/V are already in the cache
  behind a cached prefix (chunked prefill, prefix-cache hits, and decode rows in a mixed step).
  One program per ``(sequence, query head, BLOCK_M new tokens)``, causal within the chunk; key
  blocks past the tile's last position are never loaded.

Both attention kernels use the online softmax in base 2 (scores pre-multiplied by
``scale * log2(e)``), accumulate in fp32, and read the block table in the loop, so a sequence's
blocks may lie anywhere in the pool in any order.

GPU checklist (no GPU is available to this project; every kernel runs in the Triton
interpreter in the tests, and ``tests/test_attention_triton.py`` compiles each for sm_80):

* every ``tl.arange`` extent is a power of two: ``BLOCK_D`` is ``head_dim`` rounded up (80 and 96
  use 128, masked; at least 16), ``BLOCK_N`` is the KV block size (16 or 32), ``BLOCK_G`` and
  ``BLOCK_M`` are powers of two >= 16, ``BLOCK_S`` is the split count rounded up;
* tiles fit in shared memory on every targeted card (<= 64 KiB): block size <= 32, head_dim <= 128,
  ``BLOCK_M`` <= 64 (32 in fp32); the compile test reads each kernel's shared-memory use;
* every ``tl.dot`` operand is at least 16 in each dimension: ``BLOCK_G``/``BLOCK_M`` >= 16 rows,
  ``BLOCK_N`` >= 16 keys, ``BLOCK_D`` >= 16; the block size is checked to be >= 16;
* every ragged edge is masked: head_dim below ``BLOCK_D``, keys past ``seq_len`` in a last block
  (their V loads as 0, so stale inf/NaN in a reused block cannot leak),
  query rows past a chunk's end, padding rows of a GQA group below ``BLOCK_G``, empty splits,
  sliding windows; a row that sees no key in a block keeps a finite running max (no ``inf - inf``);
* fp16/bf16 operands on tensor cores with fp32 accumulation; fp32 (the interpreter's dtype here,
  as bf16 ``tl.dot`` is wrong in the interpreter, triton#11584) uses IEEE precision, not TF32;
* pointer offsets that can exceed 2**31 (block id times block stride, token index times token
  stride) are computed in int64.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmd.kernels.launch import next_power_of_2

MIN_BLOCK = 16  # tl.dot needs every operand dimension >= 16
# Tiles must fit in shared memory: 64 KiB on the smallest card targeted (Turing, sm_75), ~100 KiB on
# consumer Ampere/Ada. The K/V tile is one KV block, so the block size and head_dim are capped,
# and fp32 uses a quarter of the query rows. The largest allowed tiles need <= 49 KiB (compile test).
MAX_BLOCK_SIZE = 32
MAX_HEAD_DIM = 128
EXTEND_MAX_BLOCK_M = {torch.float16: 64, torch.bfloat16: 64, torch.float32: 16}
# Register-bound below these (ptxas, tests/test_attention_triton.py): with 4 warps a 64-row fp16 tile
# of head_dim 128 spilled ~9 KB on sm_75 and 32-row fp32 tiles 76-140 B on sm_80; 8 warps and these
# caps spill nothing. Turing (sm_75) has no bf16 and runs fp16 tiles of at most 32 rows.
EXTEND_NUM_WARPS = 8
TURING_EXTEND_MAX_BLOCK_M = 32
_capabilities: dict[int, tuple[int, int]] = {}
# Split-K for decode: aim for about this many programs per step (a GPU's SM count is ~30-140),
# but give each split at least MIN_BLOCKS_PER_SPLIT KV blocks, or combining costs more than it saves.
DECODE_TARGET_PROGRAMS = 128
MIN_BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 16
LOG2E = 1.4426950408889634

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # A negative slot (a padding token) writes nothing: its row width is 0. (A scalar `slot >= 0`
    # and-ed into the mask is what this means, but the interpreter rejects that mask's dtype.)
    width = tl.where(slot >= 0, HEAD_DIM, 0)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < width)
    block = slot // block_size
    offset = slot % block_size
    dst = block * stride_cb + offset * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot(a, b):
    if a.dtype == tl.float32:  # as torch's fp32 matmul: full precision, not TF32
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attend_block(q, k, v, visible, m_i, l_i, acc, scale_log2):
    """One step of the online softmax over a key tile: ``q [R, D]``, ``k``/``v [N, D]``,
    ``visible [R, N]``; returns the updated running max, sum and accumulator of the R rows."""
    s = _dot(q, tl.trans(k)) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead (no inf - inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _load_kv_block(k_cache_ptr, v_cache_ptr, block_table_ptr, blk, kv_head, seq_len, n, d, mask_d,
                   stride_cb, stride_cs, stride_ch, BLOCK_N: tl.constexpr):
    """The K and V tiles ``[BLOCK_N, BLOCK_D]`` of a sequence's ``blk``-th block (through its block
    table row), and the positions of their keys."""
    block_id = tl.load(block_table_ptr + blk).to(tl.int64)
    kv_off = block_id * stride_cb + n[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
    k_pos = blk * BLOCK_N + n
    # Slots past seq_len hold stale data: K there is masked out of the scores anyway, but V must be
    # loaded as 0, as a stale inf or NaN times probability 0 is NaN in P @ V.
    in_seq = (k_pos < seq_len)[:, None] & mask_d[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=in_seq, other=0.0)
    v = tl.load(v_cache_ptr + kv_off, mask=in_seq, other=0.0)
    return k, v, k_pos


@triton.jit(do_not_specialize=["stride_bt"])  # the block-table width changes step by step
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_ptr, lse_ptr,
                   scale_log2, window,
                   stride_qt, stride_qh, stride_bt, stride_cb, stride_cs, stride_ch, stride_ot, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SLIDING: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - 1
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g
    mask_g = g < GROUP
    mask_d = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)

    num_blocks = tl.cdiv(seq_len, BLOCK_N)
    first_block = 0
    if SLIDING:  # blocks wholly before the window are never read
        first_block = tl.maximum(q_pos - window + 1, 0) // BLOCK_N
    per_split = tl.cdiv(num_blocks - first_block, NUM_SPLITS)
    start = first_block + split * per_split
    end = tl.minimum(start + per_split, num_blocks)

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for blk in range(start, end):
        k, v, k_pos = _load_kv_block(k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, blk, kv_head,
                                     seq_len, n, d, mask_d, stride_cb, stride_cs, stride_ch, BLOCK_N)
        visible = k_pos < seq_len
        if SLIDING:
            visible &= q_pos - k_pos < window
        m_i, l_i, acc = _attend_block(q.to(k.dtype), k, v, visible[None, :], m_i, l_i, acc, scale_log2)

    # An empty split (more splits than blocks) has l_i = 0: its partial is 0 with weight 0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask_out = mask_g[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_out)
    else:
        # part [B, H, NUM_SPLITS, BLOCK_D] and lse [B, H, NUM_SPLITS], both fp32 and contiguous
        row = (seq * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_ptr + row[:, None] * BLOCK_D + d[None, :], out, mask=mask_out)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=mask_g)


@triton.jit
def _decode_reduce_kernel(part_ptr, lse_ptr, out_ptr, stride_ot, stride_oh,
                          HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    mask_s = s < NUM_SPLITS
    row = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    lse = tl.load(lse_ptr + row + s, mask=mask_s, other=float("-inf"))
    # Empty splits (lse = -inf) get weight 0. A row with no keys at all (seq_len 0: nothing the
    # engine sends, but a padded row could) has every split empty: its output is 0, not NaN.
    top = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    mask_d = d < HEAD_DIM
    part = tl.load(part_ptr + (row + s)[:, None] * BLOCK_D + d[None, :], mask=mask_s[:, None] & mask_d[None, :],
                   other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(part * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit(do_not_specialize=["stride_bt"])  # the block-table width changes step by step
def _extend_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr,
                   scale_log2, window,
                   stride_qt, stride_qh, stride_bt, stride_cb, stride_cs, stride_ch, stride_ot, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SLIDING: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)  # token offsets times strides can pass 2**31
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # tokens cached before this chunk (a prefix hit or earlier chunks)
    kv_head = head // GROUP
    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    mask_m = m < q_len  # the grid covers the longest chunk; shorter ones mask (or skip) the rest
    mask_d = d < HEAD_DIM
    q_pos = context + m
    q = tl.load(q_ptr + (q_start + m)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    # Causal: the tile's last row sees up to its own position, so later blocks are skipped; a
    # tile wholly past the chunk's end has end_block <= first_block and loads nothing.
    last_pos = tl.minimum(context + (m_block + 1) * BLOCK_M, seq_len) - 1
    end_block = tl.where(m_block * BLOCK_M < q_len, last_pos // BLOCK_N + 1, 0)
    first_block = 0
    if SLIDING:
        first_block = tl.maximum(context + m_block * BLOCK_M - window + 1, 0) // BLOCK_N

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for blk in range(first_block, end_block):
        k, v, k_pos = _load_kv_block(k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, blk, kv_head,
                                     seq_len, n, d, mask_d, stride_cb, stride_cs, stride_ch, BLOCK_N)
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
        if SLIDING:
            visible &= q_pos[:, None] - k_pos[None, :] < window
        m_i, l_i, acc = _attend_block(q.to(k.dtype), k, v, visible, m_i, l_i, acc, scale_log2)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + m)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


# ---------------------------------------------------------------------------------------------
# Host side: checks, launch parameters.


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] of one "
                         f"shape and dtype, got {tuple(k_cache.shape)} {k_cache.dtype} and "
                         f"{tuple(v_cache.shape)} {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if reason := unsupported(k_cache.shape[1], k_cache.shape[3], k_cache.dtype):
        raise ValueError(reason)


def unsupported(block_size: int, head_dim: int | None = None, dtype: torch.dtype | None = None) -> str | None:
    """None if the kernels run these shapes, else why not (one line)."""
    if not MIN_BLOCK <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
        return f"the Triton attention kernels need a block size of 16 or 32, got {block_size}"
    if head_dim is not None and head_dim > MAX_HEAD_DIM:
        return f"the Triton attention kernels support head_dim up to {MAX_HEAD_DIM}, got {head_dim}"
    if dtype is not None and dtype not in _DTYPES:
        return f"the KV cache must be float16, bfloat16 or float32, got {dtype}"
    return None


def _check_tokens(name: str, x: torch.Tensor, heads: int | None, head_dim: int, device: torch.device) -> None:
    if x.ndim != 3 or x.shape[2] != head_dim or (heads is not None and x.shape[1] != heads):
        want = f"[T, {heads if heads is not None else 'num_heads'}, {head_dim}]"
        raise ValueError(f"{name} must be {want}, got {tuple(x.shape)}")
    if x.stride(2) != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, the KV cache on {device}")


def _check_query(query: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Checks q against the (checked) cache and returns the GQA group size."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    _check_tokens("query", query, None, head_dim, k_cache.device)
    if query.dtype not in _DTYPES:
        raise ValueError(f"query must be float16, bfloat16 or float32, got {query.dtype}")
    if query.shape[1] % num_kv_heads:
        raise ValueError(f"query has {query.shape[1]} heads, not a multiple of the cache's {num_kv_heads} KV heads")
    return query.shape[1] // num_kv_heads


def _block_d(head_dim: int) -> int:
    return max(MIN_BLOCK, next_power_of_2(head_dim))


def _window(sliding_window: int | None) -> tuple[bool, int]:
    if sliding_window is None:
        return False, 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    return True, sliding_window


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each new token's K and V in its slot (``attention_ref.write_kv``); a negative slot is
    skipped. ``key``/``value``: ``[T, num_kv_heads, head_dim]``, last dimension contiguous."""
    _check_cache(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    _check_tokens("key", key, num_kv_heads, head_dim, k_cache.device)
    _check_tokens("value", value, num_kv_heads, head_dim, k_cache.device)
    if slot_mapping.shape != (key.shape[0],) or value.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [T] with T = {key.shape[0]} tokens, got {tuple(slot_mapping.shape)}")
    if key.shape[0] == 0:
        return
    _write_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
    )


def decode_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_size: int) -> int:
    """Splits per sequence for a decode step: enough programs to fill a GPU, each split at least
    ``MIN_BLOCKS_PER_SPLIT`` blocks long; a power of two (each value compiles its own kernel)."""
    max_blocks = -(-max_seq_len // block_size)
    want = min(-(-DECODE_TARGET_PROGRAMS // (batch * num_kv_heads)), -(-max_blocks // MIN_BLOCKS_PER_SPLIT),
               MAX_SPLITS)
    return 1 << (max(want, 1).bit_length() - 1)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, max_seq_len: int, scale: float, sliding_window: int | None = None,
                     num_splits: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence (``attention_ref.decode_attention``).

    Args:
        query: ``[B, num_heads, head_dim]``, row ``b`` the newest token of sequence ``b``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, the new tokens' K/V
            already written.
        block_tables: ``[B, max_blocks]`` int32/int64 physical block ids.
        seq_lens: ``[B]`` int32 context lengths, the new token included (each >= 1).
        max_seq_len: ``max(seq_lens)``, known on the host (it picks the split count without a sync).
        num_splits: force the split-K count (tests); default :func:`decode_splits`.

    Returns:
        ``[B, num_heads, head_dim]`` in ``query.dtype``.
    """
    _check_cache(k_cache, v_cache)
    group = _check_query(query, k_cache)
    sliding, window = _window(sliding_window)
    batch, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(f"block_tables must be [{batch}, max_blocks] and seq_lens [{batch}], got "
                         f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
    if num_splits is None:
        num_splits = decode_splits(batch, num_kv_heads, max_seq_len, block_size)
    elif num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    block_d = _block_d(head_dim)
    if num_splits > 1:
        part = torch.empty((batch, num_heads, num_splits, block_d), dtype=torch.float32, device=query.device)
        lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=query.device)
    else:
        part = lse = out  # unused: the kernel writes the result itself
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, part, lse, scale * LOG2E, window,
        query.stride(0), query.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, SLIDING=sliding,
        BLOCK_G=max(MIN_BLOCK, next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_size,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part, lse, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=next_power_of_2(num_splits), BLOCK_D=block_d,
        )
    return out


def extend_block_m(max_query_len: int, dtype: torch.dtype, capability: tuple[int, int] = (8, 0)) -> int:
    """Query rows per extend tile: the next power of two of the longest chunk, at least 16 and at
    most what fits in registers and shared memory for ``dtype`` on a GPU of ``capability``."""
    cap = EXTEND_MAX_BLOCK_M[dtype]
    if capability < (8, 0):
        cap = min(cap, TURING_EXTEND_MAX_BLOCK_M)
    return min(cap, max(MIN_BLOCK, next_power_of_2(max_query_len)))


def _capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability (cached); (8, 0) elsewhere (the interpreter)."""
    if device.type != "cuda":
        return (8, 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capabilities:
        _capabilities[index] = torch.cuda.get_device_capability(index)
    return _capabilities[index]


def extend_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, scale: float,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of a ragged batch of new chunks over paged context
    (``attention_ref.paged_attention``).

    Args:
        query: ``[T, num_heads, head_dim]``; sequence ``i``'s rows are
            ``query_start_loc[i] .. query_start_loc[i+1]``.
        k_cache, v_cache: the paged cache, every new token's K/V already written.
        block_tables: ``[num_seqs, max_blocks]``.
        query_start_loc: ``[num_seqs + 1]`` int32 cumulative chunk lengths, starting at 0.
        seq_lens: ``[num_seqs]`` int32 total lengths after this step.
        max_query_len: the longest chunk, known on the host (sizes the grid).

    Returns:
        ``[T, num_heads, head_dim]`` in ``query.dtype``.
    """
    _check_cache(k_cache, v_cache)
    group = _check_query(query, k_cache)
    sliding, window = _window(sliding_window)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}] and block_tables [{num_seqs}, max_blocks], got "
                         f"{tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}")
    total, num_heads, head_dim = query.shape
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if total == 0:
        return out
    block_m = extend_block_m(max_query_len, query.dtype, _capability(query.device))
    grid = (num_seqs, num_heads, math.ceil(max_query_len / block_m))
    _extend_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale * LOG2E, window,
        query.stride(0), query.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, SLIDING=sliding,
        BLOCK_M=block_m, BLOCK_D=_block_d(head_dim), BLOCK_N=k_cache.shape[1], num_warps=EXTEND_NUM_WARPS,
    )
    return out
