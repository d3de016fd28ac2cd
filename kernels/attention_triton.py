"""Triton paged attention: KV-cache writes, decode with split-K, and prefill/extend over paged blocks.

The cache layout is the torch reference's (``attention_ref.py``): per layer, K and V each
``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's slot is
``block_id * block_size + offset``. Three kernels, one job each:

* ``_write_kv_kernel`` stores each new token's K and V in its slot (one program per token;
  a negative slot is skipped, so padded batches need no special case); prompt chunks use it.
* ``_decode_kernel`` attends one new token per sequence (a pure decode step). One program per
  ``(sequence, KV head, split)``: the query heads sharing that KV head are the rows of one tile,
  so each K/V block is read once per KV head, not once per query head (GQA, any ratio). With
  more than one split the sequence's blocks are divided between programs (flash-decoding), and
  the last program of a (sequence, KV head) to finish combines the partial results by their
  log-sum-exp, in the same launch. Fed straight from the qkv projection
  (:func:`decode_attention_new_token`), it also applies RoPE (and Qwen3's q/k norm) and writes
  the new token's K/V, so a decode step's attention is one launch (issue 19: a GPU decode step is
  bound by launches). The split count is a runtime argument: no recompile as contexts grow.
* ``_extend_kernel`` attends a ragged batch of chunks: sequence ``i`` brings ``query_len`` new
  tokens at positions ``seq_len - query_len .. seq_len - 1`` whose K/V are already in the cache
  behind a cached prefix (chunked prefill, prefix-cache hits, and decode rows in a mixed step).
  One program per ``(sequence, KV head, BLOCK_T new tokens)``, the tile's rows those tokens times
  the query heads sharing the KV head (each K/V tile read once per KV head, not per query head);
  a key tile spans 64 keys (32 in fp32) across several cache blocks; causal within the chunk,
  keys past the tile's last position never loaded.

Both attention kernels use the online softmax in base 2 (scores pre-multiplied by
``scale * log2(e)``), accumulate in fp32, and read the block table in the loop, so a sequence's
blocks may lie anywhere in the pool in any order.

GPU checklist (no GPU is available to this project; every kernel runs in the Triton
interpreter in the tests, and ``tests/test_attention_triton.py`` compiles each for sm_80):

* every ``tl.arange`` extent is a power of two: ``BLOCK_D`` is ``head_dim`` rounded up (80 and 96
  use 128, masked; at least 16), ``BLOCK_N`` is the KV block size (16 or 32) in decode and a
  multiple of it in extend, the decode ``BLOCK_G`` and the extend tile's rows are >= 16;
* tiles fit in shared memory on every targeted card (64 KiB on Turing, 99 KiB on consumer
  Ampere/Ada): block size <= 32, head_dim <= 128, extend tiles of at most 64 rows and 64 keys
  (Turing 32 and 32, fp32 16 and 32); the compile test reads each kernel's shared-memory use
  (at most 57 KiB, 81 KiB on Hopper, whose pipelining takes more of its 227);
* every ``tl.dot`` operand is at least 16 in each dimension: 16 rows or more, ``BLOCK_N`` >= 16
  keys, ``BLOCK_D`` >= 16; the block size is checked to be >= 16;
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

import functools
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from llmd.kernels.kv_format import head_dim_of
from llmd.kernels.launch import arrival_counters, next_power_of_2, workspace

MIN_BLOCK = 16  # tl.dot needs every operand dimension >= 16
# Tiles must fit in shared memory: 64 KiB on the smallest card targeted (Turing, sm_75), ~100 KiB on
# consumer Ampere/Ada. The decode kernel's K/V tile is one KV block, so the block size and head_dim
# are capped; the extend kernel's tiles are below.
MAX_BLOCK_SIZE = 32
MAX_HEAD_DIM = 128
# The extend kernel's tiles: query rows (tokens x the GQA group's heads) and keys (several KV
# blocks). Register- and shared-memory-bound at these (ptxas, tests/test_attention_triton.py, 8
# warps, head_dim 128): larger spilled. Turing (sm_75) has no bf16 and runs fp16 tiles of fewer rows.
EXTEND_ROWS = {torch.float16: 64, torch.bfloat16: 64, torch.float32: 16}
EXTEND_KEYS = {torch.float16: 64, torch.bfloat16: 64, torch.float32: 32}
EXTEND_NUM_WARPS = 8
TURING_EXTEND_ROWS, TURING_EXTEND_KEYS = 32, 32  # 64 keys spilled ~0.5 KB there
# The decode kernel on Turing: 8 warps (4 spilled ~0.5 KB fed from the qkv projection, head_dim 128,
# 8 query heads per KV head); 4 elsewhere.
TURING_DECODE_NUM_WARPS = 8
_capabilities: dict[int, tuple[int, int]] = {}
# Split-K for decode: aim for about this many programs per step (a GPU's SM count is ~30-140),
# but give each split at least MIN_BLOCKS_PER_SPLIT KV blocks, or combining costs more than it saves.
DECODE_TARGET_PROGRAMS = 128
MIN_BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 16
LOG2E = 1.4426950408889634

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CACHE_DTYPES = (*_DTYPES, torch.int8)  # int8: rows of values and an fp16 scale (llmd.kernels.kv_format)


@triton.jit
def _round_half_even(y):
    """``y`` rounded to the nearest integer, ties to even (as torch.round and the C kernels)."""
    r = tl.floor(y + 0.5)
    odd = r - 2.0 * tl.floor(r * 0.5) != 0.0
    return tl.where((r - y == 0.5) & odd, r - 1.0, r)


@triton.jit
def _store_int8_rows(cache_ptr, scale_ptr, row_off, d, mask, x, HEAD_DIM: tl.constexpr):
    """Rows ``x [R, BLOCK_D]`` (fp32) as int8 cache rows at ``row_off [R]`` (elements of the int8
    cache), as llmd.kernels.kv_format.quantize_rows writes them: the values, then the row's scale
    (amax / 127 rounded up to an fp16) in its last two bytes, through ``scale_ptr``, the cache
    viewed as int16 (rows and head sizes are even, so the scale is 2-byte aligned)."""
    want = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1) / 127.0
    scale = want.to(tl.float16)
    bits = scale.to(tl.int16, bitcast=True)
    scale = tl.where(scale.to(tl.float32) < want, bits + 1, bits).to(tl.float16, bitcast=True)
    s = scale.to(tl.float32)
    y = tl.math.div_rn(x, tl.where(s > 0, s, 1.0)[:, None])  # IEEE division, as torch's
    q = tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0)
    q = tl.where(s[:, None] > 0, q, 0.0)
    tl.store(cache_ptr + row_off[:, None] + d[None, :], q.to(tl.int8), mask=mask)
    row_mask = tl.max(mask.to(tl.int32), axis=1) > 0
    tl.store(scale_ptr + (row_off + HEAD_DIM) // 2, scale.to(tl.int16, bitcast=True), mask=row_mask)


@triton.jit
def _load_rows(cache_ptr, scale_ptr, row_off, d, mask, row_mask, dtype, INT8: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Cached rows ``[R, BLOCK_D]`` at ``row_off [R]``, 0 where not ``mask``: as they are, or an int8
    cache's dequantised (values times the row's fp16 scale, in fp32, as kv_format.dequantize_rows)
    and cast to ``dtype``."""
    if INT8:
        values = tl.load(cache_ptr + row_off[:, None] + d[None, :], mask=mask, other=0).to(tl.float32)
        scale = tl.load(scale_ptr + (row_off + HEAD_DIM) // 2, mask=row_mask, other=0)
        return (values * scale.to(tl.float16, bitcast=True).to(tl.float32)[:, None]).to(dtype)
    else:
        return tl.load(cache_ptr + row_off[:, None] + d[None, :], mask=mask, other=0.0)


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr, block_size,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, INT8: tl.constexpr,
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
    row = block * stride_cb + offset * stride_cs + h * stride_ch
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if INT8:
        _store_int8_rows(k_cache_ptr, k_scale_ptr, row, d, mask, k.to(tl.float32), HEAD_DIM)
        _store_int8_rows(v_cache_ptr, v_scale_ptr, row, d, mask, v.to(tl.float32), HEAD_DIM)
    else:
        tl.store(k_cache_ptr + row[:, None] + d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + row[:, None] + d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


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
def _load_kv_block(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, blk, kv_head, seq_len, n,
                   d, mask_d, stride_cb, stride_cs, stride_ch, dtype, INT8: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """The K and V tiles ``[BLOCK_N, BLOCK_D]`` of a sequence's ``blk``-th block (through its block
    table row; an int8 cache's dequantised to ``dtype``), and the positions of their keys."""
    block_id = tl.load(block_table_ptr + blk).to(tl.int64)
    row_off = block_id * stride_cb + n * stride_cs + kv_head * stride_ch
    k_pos = blk * BLOCK_N + n
    # Slots past seq_len hold stale data: K there is masked out of the scores anyway, but V must be
    # loaded as 0, as a stale inf or NaN times probability 0 is NaN in P @ V.
    in_seq = (k_pos < seq_len)[:, None] & mask_d[None, :]
    k = _load_rows(k_cache_ptr, k_scale_ptr, row_off, d, in_seq, k_pos < seq_len, dtype, INT8, HEAD_DIM)
    v = _load_rows(v_cache_ptr, v_scale_ptr, row_off, d, in_seq, k_pos < seq_len, dtype, INT8, HEAD_DIM)
    return k, v, k_pos


@triton.jit
def _rope_angles(pos_ptr, inv_freq_ptr, d, mask_d, dtype, HEAD_DIM: tl.constexpr):
    """cos and sin ``[BLOCK_D]`` of one token's rotation, element ``d`` at frequency ``d % (D/2)``,
    rounded to the activations' dtype as the reference's tables are."""
    inv_freq = tl.load(inv_freq_ptr + d % (HEAD_DIM // 2), mask=mask_d, other=0.0)
    angle = tl.load(pos_ptr).to(tl.float32) * inv_freq  # as the reference: fp32 position x fp32 frequency
    # tl.cos/tl.sin: libdevice's accurate cosf/sinf (see llmd.kernels.norm_act_triton)
    return tl.cos(angle).to(dtype).to(tl.float32), tl.sin(angle).to(dtype).to(tl.float32)


@triton.jit
def _rope_tile(ptr, offs, offs_p, mask, d, cos, sin, norm_ptr, eps, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
    """Rotate-half RoPE of the heads ``[R, BLOCK_D]`` at ``ptr + offs`` (``offs_p``: each element's
    partner in the other half of its head), after the per-head RMSNorm (Qwen3's q/k norm) if
    ``QK_NORM``; rounded as llmd.kernels.norm_act_triton rounds (the norm step by step, the rotation
    in fp32 once)."""
    x = tl.load(ptr + offs, mask=mask, other=0.0)
    xp = tl.load(ptr + offs_p, mask=mask, other=0.0)
    x32, xp32 = x.to(tl.float32), xp.to(tl.float32)
    if QK_NORM:
        inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=1) / HEAD_DIM + eps)[:, None]
        mask_d = d < HEAD_DIM
        w = tl.load(norm_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
        wp = tl.load(norm_ptr + (d + HEAD_DIM // 2) % HEAD_DIM, mask=mask_d, other=0.0).to(tl.float32)
        x32 = (w[None, :] * (x32 * inv_rms).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
        xp32 = (wp[None, :] * (xp32 * inv_rms).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
    sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
    return (x32 * cos[None, :] + sign[None, :] * xp32 * sin[None, :]).to(x.dtype)


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])  # both change step by step
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
                   pos_ptr, slot_ptr, inv_freq_ptr, q_norm_ptr, k_norm_ptr, out_ptr, part_ptr, lse_ptr, count_ptr,
                   scale_log2, window, eps, num_splits,
                   stride_qt, stride_qh, stride_bt,
                   stride_cb, stride_cs, stride_ch, stride_ot, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SLIDING: tl.constexpr, NEW_KV: tl.constexpr,
                   QK_NORM: tl.constexpr, INT8: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    num_heads = num_kv_heads * GROUP
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - 1
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g
    mask_g = g < GROUP
    mask_d = d < HEAD_DIM
    mask_q = mask_g[:, None] & mask_d[None, :]
    q_offs = seq * stride_qt + heads[:, None] * stride_qh + d[None, :]
    context = seq_len  # keys read from the cache
    if NEW_KV:
        # q and the new token's k/v come raw from the qkv projection: RoPE (after the q/k norm)
        # here, the new key and value attended from registers and written to the cache by the
        # last split, so no program reads the slot another writes.
        cos, sin = _rope_angles(pos_ptr + seq, inv_freq_ptr, d, mask_d, q_ptr.dtype.element_ty, HEAD_DIM)
        q_offs_p = seq * stride_qt + heads[:, None] * stride_qh + ((d + HEAD_DIM // 2) % HEAD_DIM)[None, :]
        q = _rope_tile(q_ptr, q_offs, q_offs_p, mask_q, d, cos, sin, q_norm_ptr, eps, HEAD_DIM, QK_NORM)
        context = seq_len - 1
    else:
        q = tl.load(q_ptr + q_offs, mask=mask_q, other=0.0)

    num_blocks = tl.cdiv(context, BLOCK_N)
    first_block = 0
    if SLIDING:  # blocks wholly before the window are never read
        first_block = tl.maximum(q_pos - window + 1, 0) // BLOCK_N
    per_split = tl.cdiv(num_blocks - first_block, num_splits)
    start = first_block + split * per_split
    end = tl.minimum(start + per_split, num_blocks)

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for blk in range(start, end):
        k, v, k_pos = _load_kv_block(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                     block_tables_ptr + seq * stride_bt, blk, kv_head, context, n, d, mask_d,
                                     stride_cb, stride_cs, stride_ch, q_ptr.dtype.element_ty, INT8, HEAD_DIM, BLOCK_N)
        visible = k_pos < context
        if SLIDING:
            visible &= q_pos - k_pos < window
        m_i, l_i, acc = _attend_block(q.to(k.dtype), k, v, visible[None, :], m_i, l_i, acc, scale_log2)

    if NEW_KV:
        if split == num_splits - 1:  # the new token: always visible, attended last, then stored
            m_i, l_i, acc = _attend_new_token(q, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, inv_freq_ptr,
                                              k_norm_ptr, m_i, l_i, acc, seq, kv_head, num_heads, num_kv_heads,
                                              scale_log2, eps, d, mask_d, stride_qt, stride_qh, stride_cb,
                                              stride_cs, stride_ch, HEAD_DIM, QK_NORM, BLOCK_N)
    _finish_splits(m_i, l_i, acc, out_ptr, part_ptr, lse_ptr, count_ptr, seq, kv_head, split, num_splits,
                   num_heads, num_kv_heads, heads, d, mask_g, mask_q, stride_ot, stride_oh, BLOCK_G, BLOCK_D)


@triton.jit
def _attend_new_token(q, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, inv_freq_ptr, k_norm_ptr, m_i, l_i,
                      acc, seq, kv_head, num_heads, num_kv_heads, scale_log2, eps, d, mask_d, stride_qt, stride_qh,
                      stride_cb, stride_cs, stride_ch, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """One more step of the online softmax: the new token's key and value, from the qkv row
    (RoPE'd, q/k-normed), then both written to the token's slot. Loaded here, after the loop over
    the cache, not before it: registers held across the loop spilled on sm_75."""
    cos, sin = _rope_angles(pos_ptr + seq, inv_freq_ptr, d, mask_d, q_ptr.dtype.element_ty, HEAD_DIM)
    # a qkv row holds the heads q..., k..., v..., each stride_qh apart
    k_row = seq * stride_qt + (num_heads + kv_head) * stride_qh
    k_new = _rope_tile(q_ptr, k_row + d[None, :], k_row + ((d + HEAD_DIM // 2) % HEAD_DIM)[None, :],
                       mask_d[None, :], d, cos, sin, k_norm_ptr, eps, HEAD_DIM, QK_NORM)  # [1, BLOCK_D]
    v_row = seq * stride_qt + (num_heads + num_kv_heads + kv_head) * stride_qh
    v_new = tl.load(q_ptr + v_row + d[None, :], mask=mask_d[None, :], other=0.0)
    s = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * scale_log2
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new).to(v_new.dtype).to(tl.float32)  # rounded as P is before P @ V
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    # A negative slot (a padding row) writes nothing: its row width is 0 (see _write_kv_kernel).
    width = tl.where(slot >= 0, HEAD_DIM, 0)
    dst = (slot // BLOCK_N) * stride_cb + (slot % BLOCK_N) * stride_cs + kv_head * stride_ch + d[None, :]
    tl.store(k_cache_ptr + dst, k_new.to(k_cache_ptr.dtype.element_ty), mask=d[None, :] < width)
    tl.store(v_cache_ptr + dst, v_new.to(v_cache_ptr.dtype.element_ty), mask=d[None, :] < width)
    return m_new, l_i, acc


@triton.jit
def _finish_splits(m_i, l_i, acc, out_ptr, part_ptr, lse_ptr, count_ptr, seq, kv_head, split, num_splits,
                   num_heads, num_kv_heads, heads, d, mask_g, mask_q, stride_ot, stride_oh,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store a decode program's result: straight to the output with one split; with several, its
    partial and log-sum-exp in the shared workspace (part ``[B, H, splits, BLOCK_D]`` and lse
    ``[B, H, splits]``, fp32), and the last program of a (sequence, KV head) to arrive combines the
    splits in split order (deterministic) and resets its arrival counter: one launch, no reduction
    kernel."""
    # An empty split (more splits than blocks) has l_i = 0: its partial is 0 with weight 0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
    if num_splits == 1:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_q)
    else:
        rows = (seq * num_heads + heads) * num_splits
        tl.store(part_ptr + (rows + split)[:, None] * BLOCK_D + d[None, :], out, mask=mask_q)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + rows + split, lse, mask=mask_g)
        tl.debug_barrier()  # every thread's partial results are written before the arrival is counted
        counter = count_ptr + seq * num_kv_heads + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == num_splits - 1:
            # .cg: from L2, where the other programs' stores are, never a stale L1 line
            top = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
            for s in range(0, num_splits):
                top = tl.maximum(top, tl.load(lse_ptr + rows + s, mask=mask_g, other=float("-inf"),
                                              cache_modifier=".cg"))
            # Empty splits (lse = -inf) get weight 0. A row with no keys at all (seq_len 0: nothing
            # the engine sends, but a padded row could) has every split empty: its output is 0, not NaN.
            top = tl.where(top == float("-inf"), 0.0, top)
            total = tl.zeros((BLOCK_G,), dtype=tl.float32)
            combined = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
            for s in range(0, num_splits):
                weight = tl.exp2(tl.load(lse_ptr + rows + s, mask=mask_g, other=float("-inf"),
                                         cache_modifier=".cg") - top)
                part = tl.load(part_ptr + (rows + s)[:, None] * BLOCK_D + d[None, :], mask=mask_q, other=0.0,
                               cache_modifier=".cg")
                combined += part * weight[:, None]
                total += weight
            out = combined / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_q)
            tl.atomic_xchg(counter, 0)


@triton.jit(do_not_specialize=["stride_bt"])  # the block-table width changes step by step
def _extend_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
                   query_start_ptr, out_ptr, scale_log2, window,
                   stride_qt, stride_qh, stride_bt, stride_cb, stride_cs, stride_ch, stride_ot, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SLIDING: tl.constexpr, INT8: tl.constexpr,
                   BLOCK_T: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, KV_BLOCK: tl.constexpr):
    # One program per (sequence, KV head, BLOCK_T new tokens): its rows are those tokens times the
    # GROUP query heads that share the KV head (row r: token r // BLOCK_G, head r % BLOCK_G), so
    # each K/V tile is read once per KV head. A key tile is BLOCK_N keys across BLOCK_N / KV_BLOCK
    # cache blocks, each key's block looked up in the block table.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    t_block = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)  # token offsets times strides can pass 2**31
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # tokens cached before this chunk (a prefix hit or earlier chunks)
    r = tl.arange(0, BLOCK_T * BLOCK_G)
    tok = t_block * BLOCK_T + r // BLOCK_G
    head = kv_head * GROUP + r % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    mask_r = (tok < q_len) & (r % BLOCK_G < GROUP)  # the grid covers the longest chunk; shorter ones mask
    mask_d = d < HEAD_DIM
    q_pos = context + tok
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=mask_r[:, None] & mask_d[None, :], other=0.0)

    # Causal: the tile's last token sees up to its own position, so later keys are never loaded; a
    # tile wholly past the chunk's end has end_key <= first_key and loads nothing.
    last_pos = tl.minimum(context + (t_block + 1) * BLOCK_T, seq_len) - 1
    end_key = tl.where(t_block * BLOCK_T < q_len, last_pos + 1, 0)
    first_key = 0
    if SLIDING:
        first_key = tl.maximum(context + t_block * BLOCK_T - window + 1, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full((BLOCK_T * BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_T * BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_T * BLOCK_G, BLOCK_D), dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for k0 in range(first_key, end_key, BLOCK_N):
        k_pos = k0 + n
        in_seq = k_pos < seq_len
        block_id = tl.load(table + k_pos // KV_BLOCK, mask=in_seq, other=0).to(tl.int64)
        kv_off = block_id * stride_cb + (k_pos % KV_BLOCK) * stride_cs + kv_head * stride_ch
        # Slots past seq_len hold stale data: K there is masked out of the scores anyway, but V must
        # be loaded as 0, as a stale inf or NaN times probability 0 is NaN in P @ V.
        kv_mask = in_seq[:, None] & mask_d[None, :]
        k = _load_rows(k_cache_ptr, k_scale_ptr, kv_off, d, kv_mask, in_seq, q_ptr.dtype.element_ty, INT8, HEAD_DIM)
        v = _load_rows(v_cache_ptr, v_scale_ptr, kv_off, d, kv_mask, in_seq, q_ptr.dtype.element_ty, INT8, HEAD_DIM)
        visible = (k_pos[None, :] <= q_pos[:, None]) & in_seq[None, :]
        if SLIDING:
            visible &= q_pos[:, None] - k_pos[None, :] < window
        m_i, l_i, acc = _attend_block(q.to(k.dtype), k, v, visible, m_i, l_i, acc, scale_log2)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])


# ---------------------------------------------------------------------------------------------
# Host side: checks, launch parameters.


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] of one "
                         f"shape and dtype, got {tuple(k_cache.shape)} {k_cache.dtype} and "
                         f"{tuple(v_cache.shape)} {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if k_cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"the KV cache must be float16, bfloat16, float32 or int8, got {k_cache.dtype}")
    head_dim = head_dim_of(k_cache)
    if k_cache.dtype == torch.int8 and head_dim % 2:
        raise ValueError(f"an int8 KV cache needs an even head_dim (its scales are 2-byte aligned), got {head_dim}")
    if reason := unsupported(k_cache.shape[1], head_dim):
        raise ValueError(reason)


def _scales(cache: torch.Tensor) -> torch.Tensor:
    """What the kernels read an int8 cache's row scales through: the cache viewed as int16 (the
    cache itself for other dtypes, never read then)."""
    return cache.view(torch.int16) if cache.dtype == torch.int8 else cache


def unsupported(block_size: int, head_dim: int | None = None, dtype: torch.dtype | None = None) -> str | None:
    """None if the kernels run these shapes, else why not (one line)."""
    if not MIN_BLOCK <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
        return f"the Triton attention kernels need a block size of 16 or 32, got {block_size}"
    if head_dim is not None and head_dim > MAX_HEAD_DIM:
        return f"the Triton attention kernels support head_dim up to {MAX_HEAD_DIM}, got {head_dim}"
    if dtype is not None and dtype not in _DTYPES:
        return f"the Triton attention kernels compute in float16, bfloat16 or float32, got {dtype}"
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
    num_kv_heads, head_dim = k_cache.shape[2], head_dim_of(k_cache)
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
    num_kv_heads, head_dim = k_cache.shape[2], head_dim_of(k_cache)
    _check_tokens("key", key, num_kv_heads, head_dim, k_cache.device)
    _check_tokens("value", value, num_kv_heads, head_dim, k_cache.device)
    if slot_mapping.shape != (key.shape[0],) or value.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [T] with T = {key.shape[0]} tokens, got {tuple(slot_mapping.shape)}")
    if key.shape[0] == 0:
        return
    _write_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, _scales(k_cache), _scales(v_cache), slot_mapping, k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, INT8=k_cache.dtype == torch.int8,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
    )


@functools.lru_cache(maxsize=4096)  # a decode step asks once per layer
def decode_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_size: int) -> int:
    """Splits per sequence for a decode step: enough programs to fill a GPU, each split at least
    ``MIN_BLOCKS_PER_SPLIT`` blocks long; a power of two (each value compiles its own kernel)."""
    max_blocks = -(-max_seq_len // block_size)
    want = min(-(-DECODE_TARGET_PROGRAMS // (batch * num_kv_heads)), -(-max_blocks // MIN_BLOCKS_PER_SPLIT),
               MAX_SPLITS)
    return 1 << (max(want, 1).bit_length() - 1)


def _check_decode_batch(batch: int, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(f"block_tables must be [{batch}, max_blocks] and seq_lens [{batch}], got "
                         f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")


def _decode_kwargs(group: int, head_dim: int, block_size: int, sliding: bool, new_kv: bool, qk_norm: bool,
                   device: torch.device, int8: bool = False) -> dict:
    """The decode kernel's constexprs and warps."""
    return dict(GROUP=group, HEAD_DIM=head_dim, SLIDING=sliding, NEW_KV=new_kv, QK_NORM=qk_norm, INT8=int8,
                BLOCK_G=max(MIN_BLOCK, next_power_of_2(group)), BLOCK_D=_block_d(head_dim), BLOCK_N=block_size,
                num_warps=TURING_DECODE_NUM_WARPS if _capability(device) < (8, 0) else 4)


def _scratch(device: torch.device, batch: int, num_heads: int, num_kv_heads: int, num_splits: int,
             block_d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(part, lse, counters)`` of a launch with ``num_splits`` splits (none needed for one)."""
    rows = batch * num_heads * num_splits if num_splits > 1 else 0
    scratch = workspace(device, rows * (block_d + 1))
    return scratch, scratch[rows * block_d:], arrival_counters(device, batch * num_kv_heads)


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
    _check_decode_batch(batch, block_tables, seq_lens)
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_splits = _check_splits(num_splits, batch, num_kv_heads, max_seq_len, block_size)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    part, lse, counters = _scratch(query.device, batch, num_heads, num_kv_heads, num_splits, _block_d(head_dim))
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, _scales(k_cache), _scales(v_cache), block_tables, seq_lens, seq_lens, seq_lens, part,
        query, query, out, part, lse, counters, scale * LOG2E, window, 0.0, num_splits, query.stride(0),
        query.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        **_decode_kwargs(group, head_dim, block_size, sliding, False, False, query.device, k_cache.dtype == torch.int8))
    return out


def _check_splits(num_splits: int | None, batch: int, num_kv_heads: int, max_seq_len: int, block_size: int) -> int:
    if num_splits is None:
        return decode_splits(batch, num_kv_heads, max_seq_len, block_size)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return num_splits


class NewTokenDecode:
    """A decode step's whole attention for one layer in one launch, straight from the qkv
    projection: RoPE of q and of the new k (after the per-head q/k RMSNorm when ``q_norm`` and
    ``k_norm`` are given, as Qwen3 has), the new K/V written to their slots, and attention over the
    cached context plus the new token. What ``rope_qk_`` + :func:`write_kv` +
    :func:`decode_attention` compute, in one kernel instead of three (issue 19).

    The layer's shapes are checked once, here, and each KV cache once, at its first call: the
    decode step calls this 30 times a step, where checks cost more host time than the launch.

    Args:
        num_heads, num_kv_heads, head_dim: the layer's shape.
        inv_freq: ``[head_dim / 2]`` fp32 RoPE frequencies (scaling applied).
        scale: the attention's; ``sliding_window``: the layer's, or None.
        q_norm, k_norm: ``[head_dim]`` weights of the per-head RMSNorms, both or neither; ``eps``.
        num_splits: force the split-K count (tests); default :func:`decode_splits`.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, inv_freq: torch.Tensor, scale: float,
                 sliding_window: int | None = None, q_norm: torch.Tensor | None = None,
                 k_norm: torch.Tensor | None = None, eps: float = 0.0, num_splits: int | None = None) -> None:
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads on {num_kv_heads} KV heads: not a multiple")
        if head_dim % 2 or head_dim > MAX_HEAD_DIM:
            raise ValueError(f"RoPE needs an even head_dim of at most {MAX_HEAD_DIM}, got {head_dim}")
        if inv_freq.shape != (head_dim // 2,) or inv_freq.dtype != torch.float32:
            raise ValueError(f"inv_freq must be [{head_dim // 2}] float32, got {tuple(inv_freq.shape)} {inv_freq.dtype}")
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm come together")
        for name, t in (("q_norm", q_norm), ("k_norm", k_norm)):
            if t is not None and (t.shape != (head_dim,) or t.dtype not in _DTYPES or not t.is_contiguous()
                                  or t.device != inv_freq.device):
                raise ValueError(f"{name} must be a contiguous [{head_dim}] float tensor on {inv_freq.device}")
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.width = (num_heads + 2 * num_kv_heads) * head_dim
        self.inv_freq, self.q_norm, self.k_norm, self.eps = inv_freq, q_norm, k_norm, eps
        self.sliding, self.window = _window(sliding_window)
        self.scale_log2 = scale * LOG2E
        self.num_splits = num_splits
        self._checked: tuple[torch.Tensor, torch.Tensor] | None = None
        self._kwargs: dict | None = None
        self._launches: dict[tuple[int, int], Callable] = {}  # by (rows, splits), for the cache checked

    def _check_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> None:
        _check_cache(k_cache, v_cache)
        if k_cache.shape[2:] != (self.num_kv_heads, self.head_dim) or k_cache.dtype != dtype:
            raise ValueError(f"the KV cache must hold {self.num_kv_heads} heads of {self.head_dim} in {dtype}, got "
                             f"{tuple(k_cache.shape)} {k_cache.dtype}")
        if self.q_norm is not None and self.q_norm.dtype != dtype:
            raise ValueError(f"q_norm must be {dtype}, got {self.q_norm.dtype}")
        self._checked = (k_cache, v_cache)
        self._launches.clear()  # they hold the old cache's strides
        self._kwargs = _decode_kwargs(self.num_heads // self.num_kv_heads, self.head_dim, k_cache.shape[1],
                                      self.sliding, True, self.q_norm is not None, k_cache.device)

    def __call__(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 max_seq_len: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Args:
            qkv: ``[B, (num_heads + 2 * num_kv_heads) * head_dim]``, q then k then v per row, as the
                fused projection (bias included) writes them; contiguous.
            k_cache, v_cache, block_tables: as :func:`decode_attention`; the new K/V are not yet
                in the cache.
            seq_lens: ``[B]`` int32 lengths, the new token included (each >= 1).
            positions: ``[B]`` the new tokens' positions; ``slot_mapping``: ``[B]`` their slots (a
                negative slot, a padding row, is not written).
            max_seq_len: ``max(seq_lens)``, known on the host (the split count).
            out: a contiguous ``[B, num_heads, head_dim]`` tensor of qkv's dtype to write into.

        Returns:
            ``[B, num_heads, head_dim]`` in ``qkv.dtype`` (``out`` if given).
        """
        out = self._check_call(qkv, k_cache, v_cache, block_tables, seq_lens, positions, slot_mapping, out)
        batch = qkv.shape[0]
        if batch == 0:
            return out
        num_splits = self.splits(batch, max_seq_len, k_cache.shape[1])
        launch = self._launches.get((batch, num_splits)) or self._launch(qkv, k_cache, batch, num_splits)
        launch(qkv, k_cache, v_cache, block_tables, seq_lens, positions, slot_mapping, out, block_tables.stride(0))
        return out

    def splits(self, batch: int, max_seq_len: int, block_size: int) -> int:
        """The split count of a step of ``batch`` rows, the longest ``max_seq_len`` tokens."""
        return self.num_splits or decode_splits(batch, self.num_kv_heads, max_seq_len, block_size)

    def bind(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
             seq_lens: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, out: torch.Tensor,
             num_splits: int) -> Callable[[], None]:
        """A call (as :meth:`__call__`, in ``num_splits`` splits, see :meth:`splits`) with its tensors
        fixed, checked now: a function of nothing that launches it on whatever they hold then (the
        decode step's persistent buffers)."""
        self._check_call(qkv, k_cache, v_cache, block_tables, seq_lens, positions, slot_mapping, out, inputs=True)
        if qkv.shape[0] == 0:
            return lambda: None
        launch = self._launches.get((qkv.shape[0], num_splits)) or self._launch(qkv, k_cache, qkv.shape[0],
                                                                                 num_splits)
        return functools.partial(launch, qkv, k_cache, v_cache, block_tables, seq_lens, positions, slot_mapping, out,
                                 block_tables.stride(0))

    def _check_call(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, positions: torch.Tensor,
                    slot_mapping: torch.Tensor, out: torch.Tensor | None, inputs: bool = False) -> torch.Tensor:
        """Check a call's arguments (the step's inputs only when the cache is new, or ``inputs``);
        returns ``out``, allocated when None."""
        batch = qkv.shape[0]
        if qkv.ndim != 2 or qkv.shape[1] != self.width or not qkv.is_contiguous():
            raise ValueError(f"qkv must be a contiguous [B, {self.width}] tensor (q, k, v heads), got "
                             f"{tuple(qkv.shape)}")
        new_cache = self._checked is None or self._checked[0] is not k_cache or self._checked[1] is not v_cache
        if new_cache:
            self._check_cache(k_cache, v_cache, qkv.dtype)
        if new_cache or inputs:
            if qkv.device != k_cache.device:
                raise ValueError(f"qkv is on {qkv.device}, the KV cache on {k_cache.device}")
            _check_decode_batch(batch, block_tables, seq_lens)
            for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
                if t.shape != (batch,) or t.dtype not in (torch.int32, torch.int64):
                    raise ValueError(f"{name} must be [{batch}] int32/int64, got {tuple(t.shape)} {t.dtype}")
        if qkv.dtype != k_cache.dtype:
            raise ValueError(f"qkv is {qkv.dtype}, the KV cache {k_cache.dtype}")
        if out is None:
            out = torch.empty((batch, self.num_heads, self.head_dim), dtype=qkv.dtype, device=qkv.device)
        elif out.shape != (batch, self.num_heads, self.head_dim) or out.dtype != qkv.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous [{batch}, {self.num_heads}, {self.head_dim}] {qkv.dtype} "
                             f"tensor, got {tuple(out.shape)} {out.dtype}")
        return out

    def _launch(self, qkv: torch.Tensor, k_cache: torch.Tensor, batch: int, num_splits: int) -> Callable:
        """The launch of ``batch`` rows in ``num_splits`` splits, everything but the step's tensors
        bound (the scratch too: a buffer grown out of later stays valid, kernels/launch.py)."""
        part, lse, counters = _scratch(qkv.device, batch, self.num_heads, self.num_kv_heads, num_splits,
                                       _block_d(self.head_dim))
        kernel = _decode_kernel[(batch, self.num_kv_heads, num_splits)]
        q_norm = qkv if self.q_norm is None else self.q_norm
        k_norm = qkv if self.k_norm is None else self.k_norm
        row, head = qkv.stride(0), self.head_dim
        cache_strides = k_cache.stride()[:3]
        out_row = self.num_heads * self.head_dim
        constants = (self.scale_log2, self.window, self.eps, num_splits)
        kwargs = self._kwargs

        def launch(qkv, k_cache, v_cache, block_tables, seq_lens, positions, slots, out, stride_bt):
            kernel(qkv, k_cache, v_cache, k_cache, v_cache, block_tables, seq_lens, positions, slots, self.inv_freq,
                   q_norm, k_norm, out, part, lse, counters, *constants, row, head, stride_bt, *cache_strides, out_row,
                   head, **kwargs)

        self._launches[(batch, num_splits)] = launch
        return launch


def decode_attention_new_token(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, positions: torch.Tensor,
                               slot_mapping: torch.Tensor, inv_freq: torch.Tensor, max_seq_len: int, scale: float,
                               sliding_window: int | None = None, q_norm: torch.Tensor | None = None,
                               k_norm: torch.Tensor | None = None, eps: float = 0.0,
                               num_splits: int | None = None) -> torch.Tensor:
    """One call of :class:`NewTokenDecode` (which see); the query head count is read from qkv's
    width and the cache's KV heads."""
    _check_cache(k_cache, v_cache)
    num_kv_heads, head_dim = k_cache.shape[2:]
    if qkv.ndim != 2 or qkv.shape[1] % head_dim or qkv.shape[1] // head_dim <= 2 * num_kv_heads \
            or (qkv.shape[1] // head_dim) % num_kv_heads:
        raise ValueError(f"qkv must be [B, (num_heads + 2 * {num_kv_heads}) * {head_dim}] with num_heads a multiple "
                         f"of {num_kv_heads}, got {tuple(qkv.shape)}")
    if qkv.dtype not in _DTYPES:
        raise ValueError(f"qkv must be float16, bfloat16 or float32, got {qkv.dtype}")
    num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
    return NewTokenDecode(num_heads, num_kv_heads, head_dim, inv_freq, scale, sliding_window, q_norm, k_norm, eps,
                          num_splits)(qkv, k_cache, v_cache, block_tables, seq_lens, positions, slot_mapping,
                                      max_seq_len)


def extend_tile(max_query_len: int, group: int, dtype: torch.dtype,
                capability: tuple[int, int] = (8, 0)) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_G, BLOCK_N)`` of the extend kernel: ``BLOCK_G`` the GQA group rounded up to a
    power of two, ``BLOCK_T`` tokens per tile so that the tile's ``BLOCK_T * BLOCK_G`` rows reach
    (but a short chunk does not pad far past) what fits in registers and shared memory for
    ``dtype`` on a GPU of ``capability``, at least 16 rows (tl.dot); ``BLOCK_N`` keys per tile."""
    block_g = next_power_of_2(group)
    turing = capability < (8, 0)
    rows = TURING_EXTEND_ROWS if turing else EXTEND_ROWS[dtype]
    block_t = max(1, rows // block_g)
    block_t = max(min(block_t, next_power_of_2(max_query_len)), -(-MIN_BLOCK // block_g))
    return block_t, block_g, TURING_EXTEND_KEYS if turing else EXTEND_KEYS[dtype]


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
    total, _, head_dim = query.shape
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if total == 0:
        return out
    block_t, block_g, block_n = extend_tile(max_query_len, group, query.dtype, _capability(query.device))
    num_kv_heads = k_cache.shape[2]
    grid = (num_seqs, num_kv_heads, math.ceil(max_query_len / block_t))
    _extend_kernel[grid](
        query, k_cache, v_cache, _scales(k_cache), _scales(v_cache), block_tables, seq_lens, query_start_loc, out,
        scale * LOG2E, window, query.stride(0), query.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, SLIDING=sliding, INT8=k_cache.dtype == torch.int8, BLOCK_T=block_t,
        BLOCK_G=block_g, BLOCK_D=_block_d(head_dim), BLOCK_N=block_n, KV_BLOCK=k_cache.shape[1],
        num_warps=EXTEND_NUM_WARPS,
    )
    return out
