"""Triton matmuls that dequantise INT4 / INT8 weights on the fly: ``y = x @ W^T``.

The weights stay in the formats of ``llmd.quant`` (``int4.py``, ``int8.py``); each weight tile is
dequantised in registers (``w = q * scale + min`` for INT4, ``w = q * scale`` for INT8, in fp32)
and multiplied with fp32 accumulation. Three paths per format:

* INT4 GEMV (decode, ``M <= GEMV_MAX_M``): every row in one program, which reads each weight tile
  once. Decode is memory-bound, so the tile's packed bytes come in 16-byte loads, and the low and
  high nibbles multiply x's even and odd elements (no byte is read twice). One row accumulates
  elementwise in fp32 and reduces once after the loop; 2..8 rows use ``tl.dot`` (tensor cores)
  with the rows padded to 16. When the output columns give fewer than ``GEMV_PROGRAMS_PER_SM``
  programs per SM, K is split among programs; the last program of a column block to finish adds
  the splits in a fixed order (deterministic, in the same launch). The dequantised weights are
  rounded to the activations' dtype, as the GEMM's tensor cores see them, so a row's result
  barely depends on which kernel its batch size picked.
* INT8 GEMV: the INT4 GEMV's structure (all rows in one program, split-K, one reduction at the
  end for one row) over int8 tiles whose rows are contiguous bytes.
* Both GEMVs take the decode step's elementwise work with them (issue 19: a GPU decode step is
  bound by kernel launches, not by bandwidth): an RMSNorm or ``SiLU(gate) * up`` prologue applied
  to x as it is loaded (each program recomputes the row's rms, a few KB read from L2), and a bias
  and residual add on the result as it is stored, in place into the residual stream.
* Dense (prefill above ``DENSE_MIN_M`` rows): the weight dequantised once, in chunks of rows, and
  multiplied by torch (cuBLAS), rounded to the activations' dtype as the kernels round it.
* GEMM (prefill up to ``DENSE_MIN_M`` rows): ``BLOCK_M x BLOCK_N`` output tiles, a loop over K in ``BLOCK_K`` steps and
  ``tl.dot`` on the dequantised tile cast to the activations' dtype (tensor cores for fp16/bf16;
  fp32 activations get an IEEE fp32 dot, as torch's fp32 matmul, not TF32).

Block sizes are untuned defaults (this project has no GPU to autotune on). The GEMMs' and the INT8
GEMV's ``BLOCK_K`` divides the group size, so a K tile lies in one group and needs one scale (and
min) per output column; the INT4 GEMV's K tile may span several groups (it loads a scale per
group). For INT4 (groups of 32/64/128) K is a multiple of every tile, so INT4 needs no K mask. INT8
per output channel (one group of K, any K) masks K instead. Register use, spills, shared memory
and load widths are checked for sm_75 to sm_90 in tests/test_quant_triton.py.

Tested on the CPU with the Triton interpreter (``TRITON_INTERPRET=1``) against
``x.float() @ dequantize_int{4,8}(w).T``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmd.kernels.launch import arrival_counters, cdiv, next_power_of_2, workspace
from llmd.quant.int4 import GROUP_SIZES as INT4_GROUP_SIZES
from llmd.quant.int4 import Int4Weight, dequantize_int4
from llmd.quant.int8 import Int8Weight, dequantize_int8

KernelPath = Literal["gemv", "gemm", "dense"]

GEMV_MAX_M = 8  # rows up to which the GEMV kernel runs; beyond, a tensor-core tile is cheaper
# Rows above which a prefill dequantises the weight once and multiplies with cuBLAS: the GEMM
# dequantises every weight tile again for each BLOCK_M rows of x, which stops paying off around here.
DENSE_MIN_M = 128
DENSE_CHUNK = 1 << 24  # weight elements dequantised at a time (64 MiB of fp32)
GEMV_BLOCK_N = 32  # small, so a decode step of a 4096-wide layer still launches 128 programs
GEMV_MAX_BLOCK_K = 128
GEMV_MIN_BLOCK_K = 32  # 16 bytes of an INT4 row: one 16-byte load per thread
GEMV_NORM_BLOCK = 256  # elements of a row per step of a norm prologue's sum of squares
GEMV_DOT_BLOCK_M = 16  # the GEMVs' rows 2..8 go through tl.dot, whose tiles have >= 16 rows
# The INT8 GEMV's K tile on that path: 128 spills registers on sm_75 (fp16) and in fp32 (the compile test).
GEMV_INT8_DOT_MAX_BLOCK_K = 64
# Programs a GEMV launch aims for: two per SM of the GPU (split-K makes up what the columns lack);
# where there is no GPU (tests, the launch-count benchmark), an H100's 132 SMs.
GEMV_PROGRAMS_PER_SM = 2
DEFAULT_SMS = 132
GEMM_BLOCK_N = 64
GEMM_MAX_BLOCK_M = 64
GEMM_MAX_BLOCK_K = 32  # 64 spills registers on sm_75 (fp16) and in fp32 (tests/test_quant_triton.py)
MIN_BLOCK = 16  # tl.dot needs every tile dimension >= 16

_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _path_for(m: int) -> KernelPath:
    """The kernel the matmuls use for ``m`` rows of activations."""
    if m <= GEMV_MAX_M:
        return "gemv"
    return "gemm" if m <= DENSE_MIN_M else "dense"


def _dense_matmul(x: torch.Tensor, rows: int, dequantize) -> torch.Tensor:
    """``x @ W^T`` through torch's matmul (cuBLAS on a GPU), ``W`` dequantised ``DENSE_CHUNK``
    elements of rows at a time by ``dequantize(start, stop)`` (fp32), rounded to ``x.dtype`` as the
    Triton kernels round it."""
    step = max(1, DENSE_CHUNK // x.shape[1])
    parts = [F.linear(x, dequantize(start, min(start + step, rows)).to(x.dtype)) for start in range(0, rows, step)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


_sm_counts: dict[int, int] = {}


def _programs_wanted(device: torch.device) -> int:
    if device.type != "cuda":
        return GEMV_PROGRAMS_PER_SM * DEFAULT_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return GEMV_PROGRAMS_PER_SM * _sm_counts[index]


def _gemv_split(n_blocks: int, k_iters: int, device: torch.device) -> int:
    """K splits for a GEMV of ``n_blocks`` column blocks and ``k_iters`` K tiles: as many as the
    column blocks need to reach :func:`_programs_wanted` programs, at most one per K tile."""
    return min(k_iters, max(1, cdiv(_programs_wanted(device), n_blocks)))


@functools.lru_cache(maxsize=256)  # a model has a handful of shapes; a step asks ~120 times
def gemv_plan(n: int, k: int, device: torch.device) -> tuple[int, int]:
    """``(BLOCK_K, split)`` of the INT4 GEMV for an ``[n, k]`` weight: the largest K tile (<=
    GEMV_MAX_BLOCK_K, dividing K) that still leaves enough tiles to fill the GPU, then as many
    K splits as :func:`_gemv_split` gives."""
    programs = _programs_wanted(device)
    n_blocks = cdiv(n, GEMV_BLOCK_N)
    block_k = GEMV_MAX_BLOCK_K
    while k % block_k:
        block_k //= 2
    while block_k > GEMV_MIN_BLOCK_K and n_blocks * (k // block_k) < programs:
        block_k //= 2
    return block_k, _gemv_split(n_blocks, k // block_k, device)


def _block_k(group_size: int, max_block_k: int) -> int:
    """The largest power of two <= ``max_block_k`` that divides ``group_size`` (a multiple of 16), so
    that a K tile lies in one group and, as K is a multiple of the group size, needs no K mask."""
    block_k = max_block_k
    while group_size % block_k:
        block_k //= 2
    return block_k


# What a GEMV does to x before multiplying (the ``PROLOGUE`` constexpr), so that a decode step's
# elementwise work rides in the matmuls' launches (issue 19: launches, not bandwidth, bound a step).
PRO_NONE, PRO_RMS_NORM, PRO_SILU_MUL = 0, 1, 2


@triton.jit
def _inv_rms(x_ptr, rows, mask_m, stride_xm, K, eps, BLOCK_M: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """``1 / rms`` of each of the rows ``[BLOCK_M]`` of x over all K (every program reads the whole
    row, a few KB from L2, to normalise its own slice of K)."""
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, NORM_BLOCK):
        k = k0 + tl.arange(0, NORM_BLOCK)
        v = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=mask_m[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)
        ss += tl.sum(v * v, axis=1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _x_values(x_ptr, offs, k, mask, inv_rms, norm_w_ptr, K, PROLOGUE: tl.constexpr):
    """x at ``offs`` (element ``k`` of its row) after the prologue, in x's dtype, rounded step by step
    as the unfused kernels (llmd.kernels.norm_act_triton) round: ``weight * norm(x)`` with the norm
    in fp32, or ``SiLU(gate) * up`` where x holds gate then up (each K wide) in a row."""
    if mask is None:  # one row: a whole tile, unmasked (K needs no mask, see the module's note)
        x = tl.load(x_ptr + offs)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if PROLOGUE == 1:
        normed = (x.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32)
        w = tl.load(norm_w_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        x = (w * normed).to(x.dtype)
    elif PROLOGUE == 2:
        gate = x.to(tl.float32)
        if mask is None:
            up = tl.load(x_ptr + offs + K).to(tl.float32)
        else:
            up = tl.load(x_ptr + offs + K, mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(x.dtype).to(tl.float32)
        x = (silu * up).to(x.dtype)
    return x


@triton.jit(do_not_specialize=["M"])  # the row count changes step by step
def _int4_gemv_kernel(x_ptr, packed_ptr, scales_ptr, mins_ptr, out_ptr, part_ptr, count_ptr,
                      norm_w_ptr, bias_ptr, res_ptr, M, N, K, eps,
                      stride_xm, stride_wn, stride_sn, stride_om, stride_rm, K_ITERS, SPLIT,
                      GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      NG: tl.constexpr, GH: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_RESIDUAL: tl.constexpr, NORM_BLOCK: tl.constexpr):
    # A weight tile is BLOCK_N rows x NG groups x GH bytes (2 * GH elements) of each group: the
    # bytes of a row are contiguous (one 16-byte load per thread where GH >= 16), and each
    # (row, group) needs one scale and min. Byte i holds element 2i (low nibble) and 2i + 1 (high):
    # the low nibbles multiply x's even elements, the high ones its odd elements.
    BLOCK_K: tl.constexpr = NG * 2 * GH
    BLOCK_KH: tl.constexpr = NG * GH
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_g = tl.arange(0, NG)
    tile_byte = offs_g[:, None] * GH + tl.arange(0, GH)[None, :]  # [NG, GH]: 0 .. BLOCK_KH - 1
    w_ptrs = packed_ptr + offs_n[:, None, None] * stride_wn + tile_byte[None, :, :]
    rows = tl.arange(0, BLOCK_M)
    mask_m = rows < M
    x_dtype = x_ptr.dtype.element_ty
    inv_rms = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 1:
        inv_rms = _inv_rms(x_ptr, rows, mask_m, stride_xm, K, eps, BLOCK_M, NORM_BLOCK)
    if BLOCK_M == 1:
        acc3 = tl.zeros((BLOCK_N, NG, GH), dtype=tl.float32)  # summed once, after the loop
        row_rms = tl.sum(inv_rms, axis=0)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        row_rms = inv_rms[:, None]
    # This program's share of the K tiles (split-K: SPLIT programs per column block).
    for it in range(split * K_ITERS // SPLIT, (split + 1) * K_ITERS // SPLIT):
        k0 = it * BLOCK_K
        byte = tl.load(w_ptrs + k0 // 2, mask=mask_n[:, None, None], other=0)
        group = (k0 + offs_g * (2 * GH)) // GROUP_SIZE  # [NG]
        s_ptrs = offs_n[:, None] * stride_sn + group[None, :]
        scale = tl.load(scales_ptr + s_ptrs, mask=mask_n[:, None], other=0.0).to(tl.float32)[:, :, None]
        min_ = tl.load(mins_ptr + s_ptrs, mask=mask_n[:, None], other=0.0).to(tl.float32)[:, :, None]
        # Rounded to the activations' dtype, as the GEMM's tensor cores see them: a row's logits
        # do not depend on the kernel its batch size picks.
        lo = ((byte & 0xF).to(tl.float32) * scale + min_).to(x_dtype)
        hi = ((byte >> 4).to(tl.float32) * scale + min_).to(x_dtype)
        if BLOCK_M == 1:
            k_even = k0 + 2 * tile_byte
            xe = _x_values(x_ptr, k_even, k_even, None, row_rms, norm_w_ptr, K, PROLOGUE).to(tl.float32)
            xo = _x_values(x_ptr, k_even + 1, k_even + 1, None, row_rms, norm_w_ptr, K, PROLOGUE).to(tl.float32)
            acc3 += lo.to(tl.float32) * xe[None, :, :] + hi.to(tl.float32) * xo[None, :, :]
        else:  # 2..BLOCK_M rows: tensor cores, the rows padded to tl.dot's 16
            kk = k0 + 2 * tl.arange(0, BLOCK_KH)
            offs = rows[:, None] * stride_xm + kk[None, :]
            xe = _x_values(x_ptr, offs, kk[None, :], mask_m[:, None], row_rms, norm_w_ptr, K, PROLOGUE)
            xo = _x_values(x_ptr, offs + 1, kk[None, :] + 1, mask_m[:, None], row_rms, norm_w_ptr, K, PROLOGUE)
            lo2 = tl.trans(tl.reshape(lo, (BLOCK_N, BLOCK_KH)))
            hi2 = tl.trans(tl.reshape(hi, (BLOCK_N, BLOCK_KH)))
            if x_dtype == tl.float32:  # as torch's fp32 matmul: full precision, not TF32
                acc = tl.dot(xe, lo2, acc, input_precision="ieee")
                acc = tl.dot(xo, hi2, acc, input_precision="ieee")
            else:
                acc = tl.dot(xe, lo2, acc)
                acc = tl.dot(xo, hi2, acc)
    if BLOCK_M == 1:
        acc = tl.sum(tl.sum(acc3, axis=2), axis=1)[None, :]
    _store_split(acc, out_ptr, part_ptr, count_ptr, bias_ptr, res_ptr, pid_n, split, SPLIT, rows, mask_m,
                 offs_n, mask_n, N, stride_om, stride_rm, BLOCK_M, BLOCK_N, HAS_BIAS, HAS_RESIDUAL)


@triton.jit
def _epilogue(total, out_ptr, bias_ptr, res_ptr, rows, mask_m, offs_n, mask_n, stride_om, stride_rm,
              HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Store ``residual + (total + bias)``, each step rounded to the output dtype as torch's separate
    adds would round it. The residual may be the output itself (in place): each element is read
    and written by the one program that stores it."""
    mask = mask_m[:, None] & mask_n[None, :]
    out_dtype = out_ptr.dtype.element_ty
    y = total.to(out_dtype)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + bias[None, :]).to(out_dtype)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rows[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
        y = (y.to(tl.float32) + res.to(tl.float32)).to(out_dtype)
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], y, mask=mask)


@triton.jit
def _store_split(acc, out_ptr, part_ptr, count_ptr, bias_ptr, res_ptr, pid_n, split, SPLIT, rows, mask_m,
                 offs_n, mask_n, N, stride_om, stride_rm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Write a program's ``[BLOCK_M, BLOCK_N]`` sums: straight through the epilogue without split-K;
    with it, to this split's slice of ``part`` and, in the last of the column block's programs to
    arrive, the sum of all slices in split order (deterministic) through the epilogue. One launch,
    no second reduction kernel. The arrival counter is reset for the next launch (CUDA graphs)."""
    if SPLIT == 1:
        _epilogue(acc, out_ptr, bias_ptr, res_ptr, rows, mask_m, offs_n, mask_n, stride_om, stride_rm,
                  HAS_BIAS, HAS_RESIDUAL)
    else:
        mask = mask_m[:, None] & mask_n[None, :]
        part_ptrs = part_ptr + rows[:, None] * N + offs_n[None, :]
        tl.store(part_ptrs + split * BLOCK_M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial sums are written before the arrival is counted
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, SPLIT):
                # .cg: from L2, where the other programs' stores are, never a stale L1 line
                total += tl.load(part_ptrs + s * BLOCK_M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _epilogue(total, out_ptr, bias_ptr, res_ptr, rows, mask_m, offs_n, mask_n, stride_om, stride_rm,
                      HAS_BIAS, HAS_RESIDUAL)
            tl.atomic_xchg(count_ptr + pid_n, 0)


@triton.jit(do_not_specialize=["M"])  # the row count changes step by step
def _int4_gemm_kernel(x_ptr, packed_ptr, scales_ptr, mins_ptr, out_ptr, M, N, K,
                      stride_xm, stride_xk, stride_om, stride_on,
                      GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    n_groups = K // GROUP_SIZE
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides the group size, hence K: no K mask
        k = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk, mask=mask_m[:, None], other=0.0)
        # The W^T tile [BLOCK_K, BLOCK_N]; element k is in byte k // 2 (low nibble if k is even).
        byte = tl.load(packed_ptr + offs_n[None, :] * (K // 2) + k[:, None] // 2, mask=mask_n[None, :], other=0)
        q = (byte.to(tl.int32) >> ((k[:, None] % 2) * 4)) & 0xF
        group = k0 // GROUP_SIZE
        scale = tl.load(scales_ptr + offs_n * n_groups + group, mask=mask_n, other=0.0).to(tl.float32)
        min_ = tl.load(mins_ptr + offs_n * n_groups + group, mask=mask_n, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) * scale[None, :] + min_[None, :]).to(x.dtype)
        if x.dtype == tl.float32:  # as torch's fp32 matmul: full precision, not TF32
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["M"])  # the row count changes step by step
def _int8_gemv_kernel(x_ptr, q_ptr, scales_ptr, out_ptr, part_ptr, count_ptr, norm_w_ptr, bias_ptr, res_ptr,
                      M, N, K, eps, stride_xm, stride_wn, stride_sn, stride_om, stride_rm, K_ITERS, SPLIT,
                      GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_RESIDUAL: tl.constexpr, NORM_BLOCK: tl.constexpr):
    # The INT4 GEMV's structure (every row in one program, split-K, the same prologues and
    # epilogue) over int8 tiles [BLOCK_N, BLOCK_K]: a row's BLOCK_K bytes are contiguous (16-byte
    # loads). BLOCK_K divides the group size, or the group is all of K (per channel), so a tile
    # needs one scale per output; K is masked (per channel, K is any width).
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    mask_m = rows < M
    x_dtype = x_ptr.dtype.element_ty
    inv_rms = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 1:
        inv_rms = _inv_rms(x_ptr, rows, mask_m, stride_xm, K, eps, BLOCK_M, NORM_BLOCK)
    if BLOCK_M == 1:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # summed once, after the loop
        row_rms = tl.sum(inv_rms, axis=0)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        row_rms = inv_rms[:, None]
    for it in range(split * K_ITERS // SPLIT, (split + 1) * K_ITERS // SPLIT):
        k = it * BLOCK_K + offs_k
        mask_k = k < K
        q = tl.load(q_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0)
        scale = tl.load(scales_ptr + offs_n * stride_sn + (it * BLOCK_K) // GROUP_SIZE, mask=mask_n,
                        other=0.0).to(tl.float32)
        w = (q.to(tl.float32) * scale[:, None]).to(x_dtype)  # rounded as the GEMM's tensor cores see it
        if BLOCK_M == 1:
            x = _x_values(x_ptr, k, k, mask_k, row_rms, norm_w_ptr, K, PROLOGUE).to(tl.float32)
            acc2 += w.to(tl.float32) * x[None, :]
        else:
            x = _x_values(x_ptr, rows[:, None] * stride_xm + k[None, :], k[None, :],
                          mask_m[:, None] & mask_k[None, :], row_rms, norm_w_ptr, K, PROLOGUE)
            if x_dtype == tl.float32:  # as torch's fp32 matmul: full precision, not TF32
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[None, :]
    _store_split(acc, out_ptr, part_ptr, count_ptr, bias_ptr, res_ptr, pid_n, split, SPLIT, rows, mask_m,
                 offs_n, mask_n, N, stride_om, stride_rm, BLOCK_M, BLOCK_N, HAS_BIAS, HAS_RESIDUAL)


@triton.jit(do_not_specialize=["M"])  # the row count changes step by step
def _int8_gemm_kernel(x_ptr, q_ptr, scales_ptr, out_ptr, M, N, K,
                      stride_xm, stride_xk, stride_om, stride_on,
                      GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    n_groups = K // GROUP_SIZE
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K  # per channel, K need not be a multiple of BLOCK_K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        q = tl.load(q_ptr + offs_n[None, :] * K + k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0)
        group = k0 // GROUP_SIZE
        scale = tl.load(scales_ptr + offs_n * n_groups + group, mask=mask_n, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) * scale[None, :]).to(x.dtype)  # W^T tile [BLOCK_K, BLOCK_N]
        if x.dtype == tl.float32:  # as torch's fp32 matmul: full precision, not TF32
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _check_x(x: torch.Tensor, k: int, device: torch.device, norm: tuple | None = None, silu: bool = False) -> None:
    """x ``[M, K]`` for a ``[N, K]`` weight (``[M, 2K]``, gate then up, with the SiLU prologue)."""
    if norm is not None and silu:
        raise ValueError("a matmul takes one prologue: norm or silu, not both")
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _ACT_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.shape[1] != (2 * k if silu else k):
        want = f"{2 * k} (gate and up, {k} each)" if silu else str(k)
        raise ValueError(f"x has {x.shape[1]} input features, the weight takes {want}")
    if x.device != device:
        raise ValueError(f"x is on {x.device}, the weight on {device}")


def _check_scales(name: str, t: torch.Tensor, shape: tuple[int, int], device: torch.device) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype not in _SCALE_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the weight on {device}")


def _check_path(path: KernelPath | None, m: int) -> KernelPath:
    if path is None:
        return _path_for(m)
    if path not in ("gemv", "gemm", "dense"):
        raise ValueError(f"path must be 'gemv', 'gemm', 'dense' or None, got {path!r}")
    return path


def _gemm_block_m(m: int) -> int:
    """Rows per GEMM tile: the next power of two of M within [16, GEMM_MAX_BLOCK_M], so a short
    prefill does not compute a mostly masked 64-row tile."""
    return min(GEMM_MAX_BLOCK_M, max(MIN_BLOCK, next_power_of_2(m)))


@dataclass(frozen=True, slots=True)
class _Fusion:
    """The checked prologue and epilogue of one matmul call (see :func:`int4_matmul`)."""

    prologue: int = PRO_NONE
    norm_weight: torch.Tensor | None = None
    norm_eps: float = 0.0
    bias: torch.Tensor | None = None
    residual: torch.Tensor | None = None


_NO_FUSION = _Fusion()


def _fusion(x: torch.Tensor, k: int, n: int, norm: tuple[torch.Tensor, float] | None, silu: bool,
            bias: torch.Tensor | None, residual: torch.Tensor | None) -> _Fusion:
    """Check the fused operands against ``x [M, K or 2K]`` and an ``[N, K]`` weight."""
    if norm is None and not silu and bias is None and residual is None:
        return _NO_FUSION
    if norm is not None:
        weight, eps = norm
        if weight.shape != (k,) or weight.dtype != x.dtype or weight.device != x.device:
            raise ValueError(f"the norm weight must be [{k}] {x.dtype} on {x.device}, got {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}")
        if not weight.is_contiguous():
            raise ValueError("the norm weight must be contiguous")
    for name, t, shape in (("bias", bias, (n,)), ("residual", residual, (x.shape[0], n))):
        if t is None:
            continue
        if tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} must be {list(shape)} {x.dtype} on {x.device}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous")
    return _Fusion(PRO_RMS_NORM if norm is not None else PRO_SILU_MUL if silu else PRO_NONE,
                   None if norm is None else norm[0], 0.0 if norm is None else float(norm[1]), bias, residual)


def _unfused(x: torch.Tensor, fusion: _Fusion, matmul) -> torch.Tensor:
    """A fused call on the GEMM and dense paths (prefill: matmul-bound, where a launch more or less
    does not matter): the prologue and the adds as separate kernels, rounded as the GEMV rounds."""
    from llmd.kernels import norm_act_triton

    if fusion.prologue == PRO_RMS_NORM:
        x = norm_act_triton.add_rms_norm(x, None, fusion.norm_weight, fusion.norm_eps)[0]
    elif fusion.prologue == PRO_SILU_MUL:
        x = norm_act_triton.silu_mul(x)
    out = matmul(x)
    if fusion.bias is not None:
        out = out + fusion.bias
    if fusion.residual is not None:
        out = fusion.residual.add_(out)
    return out


def _launch_gemv(kernel, x: torch.Tensor, weights: tuple[torch.Tensor, ...], out: torch.Tensor, n: int, k: int,
                 block_k: int, split: int, fusion: _Fusion, constexprs: dict) -> None:
    """``out = fused(x @ W^T)`` for up to GEMV_MAX_M rows in one launch (more, in launches of
    GEMV_DOT_BLOCK_M rows: only when tests force the GEMV)."""
    m = x.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    n_blocks = cdiv(n, GEMV_BLOCK_N)
    counters = arrival_counters(x.device, n_blocks)
    k_iters = cdiv(k, block_k)
    res = fusion.residual
    for start in range(0, m, GEMV_DOT_BLOCK_M):
        rows = min(m - start, GEMV_DOT_BLOCK_M)
        block_m = 1 if rows == 1 else GEMV_DOT_BLOCK_M
        part = workspace(x.device, split * block_m * n) if split > 1 else out
        kernel[(n_blocks, split)](
            x[start:], *weights, out[start:], part, counters,
            x if fusion.norm_weight is None else fusion.norm_weight, x if fusion.bias is None else fusion.bias,
            out if res is None else res[start:], rows, n, k,
            fusion.norm_eps, x.stride(0), weights[0].stride(0), weights[1].stride(0), out.stride(0),
            0 if res is None else res.stride(0), k_iters, split,
            BLOCK_M=block_m, BLOCK_N=GEMV_BLOCK_N, PROLOGUE=fusion.prologue, HAS_BIAS=fusion.bias is not None,
            HAS_RESIDUAL=res is not None, NORM_BLOCK=GEMV_NORM_BLOCK, **constexprs)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                group_size: int, *, path: KernelPath | None = None, norm: tuple[torch.Tensor, float] | None = None,
                silu: bool = False, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T -> [M, N]`` in ``x.dtype`` (fp32 accumulation) for the INT4 weight
    ``W = q * scales + mins`` held as ``packed`` uint8 ``[N, K/2]`` (element ``2i`` in the low
    nibble of byte ``i``), ``scales`` and ``mins`` ``[N, K/group_size]`` (fp32, fp16 or bf16).

    Fused around it (in the GEMV's one launch; as separate kernels on the other paths), in x's dtype:

    * ``norm=(weight [K], eps)``: x is first replaced by ``weight * rms_norm(x)``;
    * ``silu=True``: x is ``[M, 2K]``, gate then up, first replaced by ``SiLU(gate) * up``;
    * ``bias [N]`` is added to the product;
    * ``residual [M, N]``: the result is ``residual + product``, written into ``residual`` (in
      place) and returned.

    ``path`` forces the GEMV, the GEMM or the dense path (tests run each at every M); by default
    :func:`_path_for` picks by M.
    """
    if packed.ndim != 2 or packed.dtype != torch.uint8 or not packed.is_contiguous():
        raise ValueError(f"packed must be a contiguous 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"group size {group_size} must divide the input dimension {k}")
    _check_x(x, k, packed.device, norm, silu)
    _check_scales("scales", scales, (n, k // group_size), packed.device)
    _check_scales("mins", mins, (n, k // group_size), packed.device)
    path = _check_path(path, x.shape[0])
    fusion = _fusion(x, k, n, norm, silu, bias, residual)
    if path != "gemv" and fusion is not _NO_FUSION:
        return _unfused(x, fusion, lambda x: int4_matmul(x, packed, scales, mins, group_size, path=path))

    m = x.shape[0]
    if path == "dense" and m:
        return _dense_matmul(x, n, lambda a, b: dequantize_int4(
            Int4Weight(packed[a:b], scales[a:b], mins[a:b], group_size)))
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if residual is None else residual
    if m == 0 or n == 0:
        return out
    if path == "gemv":
        block_k, split = gemv_plan(n, k, x.device)
        ng = max(1, block_k // group_size)  # groups per K tile (a tile smaller than a group lies in one)
        _launch_gemv(_int4_gemv_kernel, x, (packed, scales, mins), out, n, k, block_k, split, fusion,
                     dict(GROUP_SIZE=group_size, NG=ng, GH=block_k // ng // 2))
    else:
        block_m = _gemm_block_m(m)
        grid = (cdiv(m, block_m), cdiv(n, GEMM_BLOCK_N))
        _int4_gemm_kernel[grid](x, packed, scales, mins, out, m, n, k, x.stride(0), x.stride(1),
                                out.stride(0), out.stride(1), GROUP_SIZE=group_size, BLOCK_M=block_m,
                                BLOCK_N=GEMM_BLOCK_N, BLOCK_K=_block_k(group_size, GEMM_MAX_BLOCK_K))
    return out


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, *,
                path: KernelPath | None = None, norm: tuple[torch.Tensor, float] | None = None,
                silu: bool = False, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T -> [M, N]`` in ``x.dtype`` (fp32 accumulation) for the INT8 weight
    ``W = q * scales`` held as ``qweight`` int8 ``[N, K]`` and ``scales [N, K/group_size]``;
    ``group_size == K`` is one scale per output channel, otherwise it must be a multiple of 16.
    ``norm``, ``silu``, ``bias`` and ``residual`` as for :func:`int4_matmul`.

    ``path`` forces the GEMV, the GEMM or the dense path; by default :func:`_path_for` picks by M.
    """
    if qweight.ndim != 2 or qweight.dtype != torch.int8 or not qweight.is_contiguous():
        raise ValueError(
            f"qweight must be a contiguous 2-D int8 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape
    if group_size < 1 or k % group_size:
        raise ValueError(f"group size {group_size} must divide the input dimension {k}")
    _check_x(x, k, qweight.device, norm, silu)
    _check_scales("scales", scales, (n, k // group_size), qweight.device)
    path = _check_path(path, x.shape[0])
    if path == "gemv":
        max_block_k = GEMV_MAX_BLOCK_K if x.shape[0] == 1 else GEMV_INT8_DOT_MAX_BLOCK_K
    else:
        max_block_k = GEMM_MAX_BLOCK_K
    if group_size == k:  # per channel: any K, tiles in the one group, K masked
        block_k = max_block_k
    elif group_size % MIN_BLOCK == 0:
        block_k = _block_k(group_size, max_block_k)
    else:
        raise ValueError(f"int8 group size must be the input dimension {k} or a multiple of {MIN_BLOCK}, "
                         f"got {group_size}")
    fusion = _fusion(x, k, n, norm, silu, bias, residual)
    if path != "gemv" and fusion is not _NO_FUSION:
        return _unfused(x, fusion, lambda x: int8_matmul(x, qweight, scales, group_size, path=path))

    m = x.shape[0]
    if path == "dense" and m:
        return _dense_matmul(x, n, lambda a, b: dequantize_int8(Int8Weight(qweight[a:b], scales[a:b], group_size)))
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if residual is None else residual
    if m == 0 or n == 0:
        return out
    if path == "gemv":
        split = _gemv_split(cdiv(n, GEMV_BLOCK_N), cdiv(k, block_k), x.device)
        _launch_gemv(_int8_gemv_kernel, x, (qweight, scales), out, n, k, block_k, split, fusion,
                     dict(GROUP_SIZE=group_size, BLOCK_K=block_k))
    else:
        block_m = _gemm_block_m(m)
        grid = (cdiv(m, block_m), cdiv(n, GEMM_BLOCK_N))
        _int8_gemm_kernel[grid](x, qweight, scales, out, m, n, k, x.stride(0), x.stride(1),
                                out.stride(0), out.stride(1), GROUP_SIZE=group_size, BLOCK_M=block_m,
                                BLOCK_N=GEMM_BLOCK_N, BLOCK_K=block_k)
    return out
