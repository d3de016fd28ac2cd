"""Triton matmuls that dequantise INT4 / INT8 weights on the fly: ``y = x @ W^T``.

The weights stay in the layouts of ``llmd.kernels.int_layout`` (llmd.quant's formats); each weight
tile is dequantised in registers (``w = q * scale + min`` for INT4, ``w = q * scale`` for INT8, in fp32)
and multiplied with fp32 accumulation. Three paths per format:

* INT4 GEMV (decode, ``M <= GEMV_MAX_M``): every row in one program, which reads each weight tile
  once. Decode is memory-bound, so the tile's packed bytes come in 16-byte loads, and the low and
  high nibbles multiply x's even and odd elements (no byte is read twice). One row accumulates
  elementwise in fp32 and reduces once after the loop; 2..16 rows use ``tl.dot`` (tensor cores)
  with the rows padded to 16. When the output columns give fewer than ``GEMV_PROGRAMS_PER_SM``
  programs per SM, K is split among programs; the last program of a column block to finish adds
  the splits in a fixed order (deterministic, in the same launch). The dequantised weights are
  rounded to the activations' dtype, as the GEMM's tensor cores see them, so a row's result
  barely depends on which kernel its batch size picked.
* INT8 GEMV: the INT4 GEMV's structure (all rows in one program, split-K, one reduction at the
  end for one row) over int8 tiles whose rows are contiguous bytes.
* GEMM (up to ``DENSE_MIN_M`` rows: a decode step of more than 16 sequences, short prompt
  chunks): ``BLOCK_M x BLOCK_N`` output tiles, a loop over K in ``BLOCK_K`` steps and ``tl.dot`` on
  the dequantised tile cast to the activations' dtype (tensor cores for fp16/bf16; fp32
  activations get an IEEE fp32 dot, as torch's fp32 matmul, not TF32).
* Dense (prefill above ``DENSE_MIN_M`` rows): the weight dequantised once, in chunks of rows, and
  multiplied by torch (cuBLAS), rounded to the activations' dtype as the kernels round it.

The GEMVs and the GEMMs take a decode step's elementwise work with them (issue 19: a GPU decode
step is bound by kernel launches, not by bandwidth): an RMSNorm or ``SiLU(gate) * up`` prologue
applied to x as it is loaded (each program recomputes its rows' rms, a few KB read from L2), and
a bias and residual add on the result as it is stored, in place into the residual stream. The
dense path runs them as separate kernels. :class:`FusedMatmul` binds a weight and its fusions once
for the decode step (llmd.kernels.decode_triton), so its ~120 calls skip the per-call checks.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmd.kernels.launch import arrival_counters, cdiv, next_power_of_2, workspace
from llmd.kernels.int_layout import INT4_GROUP_SIZES, dequantize_int4, dequantize_int8

KernelPath = Literal["gemv", "gemm", "dense"]

GEMV_MAX_M = 16  # rows up to which the GEMV kernel runs (one 16-row tensor-core tile); beyond, the GEMM
# Rows above which a prefill dequantises the weight once and multiplies with cuBLAS: the GEMM
# dequantises every weight tile again for each BLOCK_M rows of x, which stops paying off around here.
DENSE_MIN_M = 128
DENSE_CHUNK = 1 << 24  # weight elements dequantised at a time (64 MiB of fp32)
GEMV_BLOCK_N = 32  # small, so a decode step of a 4096-wide layer still launches 128 programs
GEMV_MAX_BLOCK_K = 128
GEMV_MIN_BLOCK_K = 32  # 16 bytes of an INT4 row: one 16-byte load per thread
GEMV_NORM_BLOCK = 256  # elements of a row per step of a norm prologue's sum of squares
GEMV_DOT_BLOCK_M = 16  # the GEMVs' rows 2..16 go through tl.dot, whose tiles have >= 16 rows
# The INT8 GEMV's K tile on that path: 128 spills registers on sm_75 (fp16) and in fp32 (the compile test).
GEMV_INT8_DOT_MAX_BLOCK_K = 64
# Programs a GEMV launch aims for: two per SM of the GPU (split-K makes up what the columns lack);
# where there is no GPU (tests, the launch-count benchmark), an H100's 132 SMs.
GEMV_PROGRAMS_PER_SM = 2
DEFAULT_SMS = 132
GEMM_BLOCK_N = 64
GEMM_MAX_BLOCK_M = 64
GEMM_NUM_WARPS = 8  # 4 spilled ~0.4 KB with 64-row tiles and a fused prologue on sm_75 (the compile test)
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


def programs_wanted(device: torch.device) -> int:
    """Programs a launch aims for on ``device``: GEMV_PROGRAMS_PER_SM per SM."""
    if device.type != "cuda":
        return GEMV_PROGRAMS_PER_SM * DEFAULT_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return GEMV_PROGRAMS_PER_SM * _sm_counts[index]


def _gemv_split(n_blocks: int, k_iters: int, device: torch.device) -> int:
    """K splits for a GEMV of ``n_blocks`` column blocks and ``k_iters`` K tiles: as many as the
    column blocks need to reach :func:`programs_wanted` programs, at most one per K tile."""
    return min(k_iters, max(1, cdiv(programs_wanted(device), n_blocks)))


@functools.lru_cache(maxsize=256)  # a model has a handful of shapes; a step asks ~120 times
def gemv_plan(n: int, k: int, device: torch.device) -> tuple[int, int]:
    """``(BLOCK_K, split)`` of the INT4 GEMV for an ``[n, k]`` weight: the largest K tile (<=
    GEMV_MAX_BLOCK_K, dividing K) that still leaves enough tiles to fill the GPU, then as many
    K splits as :func:`_gemv_split` gives."""
    programs = programs_wanted(device)
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
def _gemv_rows(x_ptr, M, stride_xm, K, eps, BLOCK_M: tl.constexpr, PROLOGUE: tl.constexpr,
               NORM_BLOCK: tl.constexpr):
    """A GEMV program's rows of x, their mask, and with the norm prologue their ``1 / rms`` as
    :func:`_x_values` takes it: a scalar for one row, a column ``[BLOCK_M, 1]`` for several."""
    rows = tl.arange(0, BLOCK_M)
    mask_m = rows < M
    inv_rms = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 1:
        inv_rms = _inv_rms(x_ptr, rows, mask_m, stride_xm, K, eps, BLOCK_M, NORM_BLOCK)
    if BLOCK_M == 1:
        row_rms = tl.sum(inv_rms, axis=0)
    else:
        row_rms = inv_rms[:, None]
    return rows, mask_m, row_rms


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
    rows, mask_m, row_rms = _gemv_rows(x_ptr, M, stride_xm, K, eps, BLOCK_M, PROLOGUE, NORM_BLOCK)
    x_dtype = x_ptr.dtype.element_ty
    if BLOCK_M == 1:
        acc3 = tl.zeros((BLOCK_N, NG, GH), dtype=tl.float32)  # summed once, after the loop
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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
def _int4_gemm_kernel(x_ptr, packed_ptr, scales_ptr, mins_ptr, out_ptr, norm_w_ptr, bias_ptr, res_ptr, M, N, K, eps,
                      stride_xm, stride_om, stride_rm,
                      GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                      NORM_BLOCK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    n_groups = K // GROUP_SIZE
    inv_rms = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 1:
        inv_rms = _inv_rms(x_ptr, offs_m, mask_m, stride_xm, K, eps, BLOCK_M, NORM_BLOCK)
    # As the GEMV: a row's BLOCK_K / 2 packed bytes are contiguous (one 16-byte load), the low
    # nibbles multiply x's even elements and the high ones its odd elements, in two dots.
    BLOCK_KH: tl.constexpr = BLOCK_K // 2
    offs_kh = tl.arange(0, BLOCK_KH)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides the group size, hence K: no K mask
        kk = k0 + 2 * offs_kh
        offs = offs_m[:, None] * stride_xm + kk[None, :]
        xe = _x_values(x_ptr, offs, kk[None, :], mask_m[:, None], inv_rms[:, None], norm_w_ptr, K, PROLOGUE)
        xo = _x_values(x_ptr, offs + 1, kk[None, :] + 1, mask_m[:, None], inv_rms[:, None], norm_w_ptr, K, PROLOGUE)
        byte = tl.load(packed_ptr + offs_n[:, None] * (K // 2) + (k0 // 2 + offs_kh)[None, :], mask=mask_n[:, None],
                       other=0)  # [BLOCK_N, BLOCK_KH]
        group = k0 // GROUP_SIZE
        scale = tl.load(scales_ptr + offs_n * n_groups + group, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        min_ = tl.load(mins_ptr + offs_n * n_groups + group, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        lo = tl.trans(((byte & 0xF).to(tl.float32) * scale + min_).to(xe.dtype))
        hi = tl.trans(((byte >> 4).to(tl.float32) * scale + min_).to(xe.dtype))
        if xe.dtype == tl.float32:  # as torch's fp32 matmul: full precision, not TF32
            acc = tl.dot(xe, lo, acc, input_precision="ieee")
            acc = tl.dot(xo, hi, acc, input_precision="ieee")
        else:
            acc = tl.dot(xe, lo, acc)
            acc = tl.dot(xo, hi, acc)
    _epilogue(acc, out_ptr, bias_ptr, res_ptr, offs_m, mask_m, offs_n, mask_n, stride_om, stride_rm, HAS_BIAS,
              HAS_RESIDUAL)


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
    rows, mask_m, row_rms = _gemv_rows(x_ptr, M, stride_xm, K, eps, BLOCK_M, PROLOGUE, NORM_BLOCK)
    x_dtype = x_ptr.dtype.element_ty
    if BLOCK_M == 1:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # summed once, after the loop
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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
def _int8_gemm_kernel(x_ptr, q_ptr, scales_ptr, out_ptr, norm_w_ptr, bias_ptr, res_ptr, M, N, K, eps,
                      stride_xm, stride_om, stride_rm,
                      GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                      NORM_BLOCK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    n_groups = K // GROUP_SIZE
    inv_rms = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 1:
        inv_rms = _inv_rms(x_ptr, offs_m, mask_m, stride_xm, K, eps, BLOCK_M, NORM_BLOCK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K  # per channel, K need not be a multiple of BLOCK_K
        x = _x_values(x_ptr, offs_m[:, None] * stride_xm + k[None, :], k[None, :], mask_m[:, None] & mask_k[None, :],
                      inv_rms[:, None], norm_w_ptr, K, PROLOGUE)
        q = tl.load(q_ptr + offs_n[None, :] * K + k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0)
        group = k0 // GROUP_SIZE
        scale = tl.load(scales_ptr + offs_n * n_groups + group, mask=mask_n, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) * scale[None, :]).to(x.dtype)  # W^T tile [BLOCK_K, BLOCK_N]
        if x.dtype == tl.float32:  # as torch's fp32 matmul: full precision, not TF32
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    _epilogue(acc, out_ptr, bias_ptr, res_ptr, offs_m, mask_m, offs_n, mask_n, stride_om, stride_rm, HAS_BIAS,
              HAS_RESIDUAL)


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
    """A fused call on the dense path (prefill of more than DENSE_MIN_M rows: matmul-bound, where a
    launch more or less does not matter): the prologue and the adds as separate kernels, rounded
    as the GEMV and GEMM round."""
    from llmd.kernels.norm_act_triton import around_matmul

    norm = None if fusion.prologue != PRO_RMS_NORM else (fusion.norm_weight, fusion.norm_eps)
    return around_matmul(x, matmul, norm=norm, silu=fusion.prologue == PRO_SILU_MUL, bias=fusion.bias,
                         residual=fusion.residual)


@dataclass(slots=True)
class _QWeight:
    """A checked INT4 (``tensors = (packed, scales, mins)``) or INT8 (``(qweight, scales)``) weight
    ``[n, k]`` and its kernels' launch constants, worked out once per row-tile size."""

    kind: Literal["int4", "int8"]
    tensors: tuple[torch.Tensor, ...]
    n: int
    k: int
    group_size: int
    _gemv: dict = field(default_factory=dict)

    def dequantize(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` in fp32."""
        t = [x[start:stop] for x in self.tensors]
        return (dequantize_int4 if self.kind == "int4" else dequantize_int8)(*t, self.group_size)

    def _k_tile(self, max_block_k: int) -> int:
        """INT8: the K tile in one group (per channel: any K, masked)."""
        return max_block_k if self.group_size == self.k else _block_k(self.group_size, max_block_k)

    def gemv(self, block_m: int, device: torch.device) -> tuple[object, int, int, dict]:
        """``(kernel, BLOCK_K, split, constexprs)`` of a GEMV launch of ``block_m``-row tiles."""
        plan = self._gemv.get(block_m)
        if plan is None:
            if self.kind == "int4":
                block_k, split = gemv_plan(self.n, self.k, device)
                ng = max(1, block_k // self.group_size)  # groups per K tile (a tile smaller than a group lies in one)
                plan = (_int4_gemv_kernel, block_k, split, dict(GROUP_SIZE=self.group_size, NG=ng,
                                                                GH=block_k // ng // 2))
            else:
                block_k = self._k_tile(GEMV_MAX_BLOCK_K if block_m == 1 else GEMV_INT8_DOT_MAX_BLOCK_K)
                split = _gemv_split(cdiv(self.n, GEMV_BLOCK_N), cdiv(self.k, block_k), device)
                plan = (_int8_gemv_kernel, block_k, split, dict(GROUP_SIZE=self.group_size, BLOCK_K=block_k))
            self._gemv[block_m] = plan
        return plan

    def gemm(self) -> tuple[object, dict]:
        """``(kernel, constexprs)`` of a GEMM launch (BLOCK_M apart)."""
        if self.kind == "int4":
            return _int4_gemm_kernel, dict(GROUP_SIZE=self.group_size, BLOCK_K=_block_k(self.group_size,
                                                                                         GEMM_MAX_BLOCK_K))
        return _int8_gemm_kernel, dict(GROUP_SIZE=self.group_size, BLOCK_K=self._k_tile(GEMM_MAX_BLOCK_K))


def _int4_weight(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> _QWeight:
    if packed.ndim != 2 or packed.dtype != torch.uint8 or not packed.is_contiguous():
        raise ValueError(f"packed must be a contiguous 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"group size {group_size} must divide the input dimension {k}")
    _check_scales("scales", scales, (n, k // group_size), packed.device)
    _check_scales("mins", mins, (n, k // group_size), packed.device)
    return _QWeight("int4", (packed, scales, mins), n, k, group_size)


def _int8_weight(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> _QWeight:
    if qweight.ndim != 2 or qweight.dtype != torch.int8 or not qweight.is_contiguous():
        raise ValueError(
            f"qweight must be a contiguous 2-D int8 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape
    if group_size < 1 or k % group_size:
        raise ValueError(f"group size {group_size} must divide the input dimension {k}")
    if group_size != k and group_size % MIN_BLOCK:
        raise ValueError(f"int8 group size must be the input dimension {k} or a multiple of {MIN_BLOCK}, "
                         f"got {group_size}")
    _check_scales("scales", scales, (n, k // group_size), qweight.device)
    return _QWeight("int8", (qweight, scales), n, k, group_size)


def _launch_gemv(w: _QWeight, x: torch.Tensor, out: torch.Tensor, fusion: _Fusion) -> None:
    """``out = fused(x @ W^T)`` for up to GEMV_MAX_M rows in one launch (more, in launches of
    GEMV_DOT_BLOCK_M rows: only when tests force the GEMV). x's rows are contiguous."""
    m, n = x.shape[0], w.n
    n_blocks = cdiv(n, GEMV_BLOCK_N)
    counters = arrival_counters(x.device, n_blocks)
    res = fusion.residual
    for start in range(0, m, GEMV_DOT_BLOCK_M):
        rows = min(m - start, GEMV_DOT_BLOCK_M)
        block_m = 1 if rows == 1 else GEMV_DOT_BLOCK_M
        kernel, block_k, split, constexprs = w.gemv(block_m, x.device)
        part = workspace(x.device, split * block_m * n) if split > 1 else out
        kernel[(n_blocks, split)](
            x[start:], *w.tensors, out[start:], part, counters,
            x if fusion.norm_weight is None else fusion.norm_weight, x if fusion.bias is None else fusion.bias,
            out if res is None else res[start:], rows, n, w.k, fusion.norm_eps, x.stride(0),
            w.tensors[0].stride(0), w.tensors[1].stride(0), out.stride(0), 0 if res is None else res.stride(0),
            cdiv(w.k, block_k), split, BLOCK_M=block_m, BLOCK_N=GEMV_BLOCK_N, PROLOGUE=fusion.prologue,
            HAS_BIAS=fusion.bias is not None, HAS_RESIDUAL=res is not None, NORM_BLOCK=GEMV_NORM_BLOCK, **constexprs)


def _launch_gemm(w: _QWeight, x: torch.Tensor, out: torch.Tensor, fusion: _Fusion) -> None:
    m = x.shape[0]
    kernel, constexprs = w.gemm()
    block_m = _gemm_block_m(m)
    res = fusion.residual
    kernel[(cdiv(m, block_m), cdiv(w.n, GEMM_BLOCK_N))](
        x, *w.tensors, out, x if fusion.norm_weight is None else fusion.norm_weight,
        x if fusion.bias is None else fusion.bias, out if res is None else res, m, w.n, w.k, fusion.norm_eps,
        x.stride(0), out.stride(0), 0 if res is None else res.stride(0), BLOCK_M=block_m, BLOCK_N=GEMM_BLOCK_N,
        PROLOGUE=fusion.prologue, HAS_BIAS=fusion.bias is not None, HAS_RESIDUAL=res is not None,
        NORM_BLOCK=GEMV_NORM_BLOCK, num_warps=GEMM_NUM_WARPS, **constexprs)


def _run(w: _QWeight, x: torch.Tensor, path: KernelPath, fusion: _Fusion,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """The checked matmul on ``path``; into ``out`` (a contiguous ``[M, N]`` of any float dtype: the
    kernels round their fp32 sums to it) when given, except on the dense path."""
    m = x.shape[0]
    if path == "dense" and m:
        if fusion is not _NO_FUSION:
            return _unfused(x, fusion, lambda h: _run(w, h, "dense", _NO_FUSION))
        return _dense_matmul(x, w.n, w.dequantize)
    if fusion.residual is not None:
        out = fusion.residual
    elif out is None:
        out = torch.empty((m, w.n), dtype=x.dtype, device=x.device)
    if m == 0 or w.n == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    (_launch_gemv if path == "gemv" else _launch_gemm)(w, x, out, fusion)
    return out


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                group_size: int, *, path: KernelPath | None = None, norm: tuple[torch.Tensor, float] | None = None,
                silu: bool = False, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T -> [M, N]`` in ``x.dtype`` (fp32 accumulation) for the INT4 weight
    ``W = q * scales + mins`` held as ``packed`` uint8 ``[N, K/2]`` (element ``2i`` in the low
    nibble of byte ``i``), ``scales`` and ``mins`` ``[N, K/group_size]`` (fp32, fp16 or bf16).

    Fused around it (in the GEMV's and the GEMM's one launch; as separate kernels on the dense
    path), in x's dtype:

    * ``norm=(weight [K], eps)``: x is first replaced by ``weight * rms_norm(x)``;
    * ``silu=True``: x is ``[M, 2K]``, gate then up, first replaced by ``SiLU(gate) * up``;
    * ``bias [N]`` is added to the product;
    * ``residual [M, N]``: the result is ``residual + product``, written into ``residual`` (in
      place) and returned.

    ``path`` forces the GEMV, the GEMM or the dense path (tests run each at every M); by default
    :func:`_path_for` picks by M.
    """
    w = _int4_weight(packed, scales, mins, group_size)
    _check_x(x, w.k, packed.device, norm, silu)
    return _run(w, x, _check_path(path, x.shape[0]), _fusion(x, w.k, w.n, norm, silu, bias, residual))


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
    w = _int8_weight(qweight, scales, group_size)
    _check_x(x, w.k, qweight.device, norm, silu)
    return _run(w, x, _check_path(path, x.shape[0]), _fusion(x, w.k, w.n, norm, silu, bias, residual))


class FusedMatmul:
    """One projection's matmul with its fusions fixed, for a decode step's ~120 calls: the weight
    and the fused operands are checked once, here, and a call of 1..GEMV_MAX_M contiguous rows goes
    straight to its one GEMV launch, its arguments worked out at the first call of its tile size
    (:func:`int4_matmul`'s checks and set-up cost more host time than the launch: measured ~12 us
    a call against ~4 here). Other calls take the path :func:`int4_matmul` would.

    ``fused(x)`` returns ``x @ W^T`` with the fusions; with ``add_residual`` it is
    ``fused(x, residual)``, which adds into ``residual`` in place and returns it.
    """

    def __init__(self, weight: _QWeight, dtype: torch.dtype, *, norm: tuple[torch.Tensor, float] | None = None,
                 silu: bool = False, bias: torch.Tensor | None = None, add_residual: bool = False,
                 out_dtype: torch.dtype | None = None) -> None:
        device = weight.tensors[0].device
        if out_dtype is not None and (out_dtype not in _ACT_DTYPES or add_residual):
            raise ValueError(f"out_dtype must be float16, bfloat16 or float32, and without a residual; got {out_dtype}")
        self._width = 2 * weight.k if silu else weight.k
        probe = torch.empty((1, self._width), dtype=dtype, device=device)
        _check_x(probe, weight.k, device, norm, silu)
        self._fused = _fusion(probe, weight.k, weight.n, norm, silu, bias, None)  # checks the norm weight, bias
        if self._fused is _NO_FUSION:
            self._fused = _Fusion()
        self.weight, self.dtype, self.add_residual, self.device = weight, dtype, add_residual, device
        self.out_dtype = out_dtype or dtype
        # the fusions as bound (llmd.kernels.mlp_triton fuses a gate/up and a down into one launch)
        self.norm, self.silu, self.bias = norm, silu, bias
        self._plans: dict[int, tuple] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the weight (and its scales and mins)."""
        return sum(t.numel() * t.element_size() for t in self.weight.tensors)

    def _plan(self, block_m: int) -> tuple:
        """What a launch of ``block_m``-row tiles passes besides x, out and the residual."""
        w, f = self.weight, self._fused
        kernel, block_k, split, constexprs = w.gemv(block_m, self.device)
        n_blocks = cdiv(w.n, GEMV_BLOCK_N)
        # Scratch taken now and held: a buffer grown out of later stays valid (kernels/launch.py).
        part = workspace(self.device, split * block_m * w.n) if split > 1 else None
        counters = arrival_counters(self.device, n_blocks)
        kwargs = dict(constexprs, BLOCK_M=block_m, BLOCK_N=GEMV_BLOCK_N, PROLOGUE=f.prologue,
                      HAS_BIAS=f.bias is not None, HAS_RESIDUAL=self.add_residual, NORM_BLOCK=GEMV_NORM_BLOCK)
        plan = (kernel[(n_blocks, split)], part, counters, f.norm_weight, f.bias, w.n, w.k, f.norm_eps,
                w.tensors[0].stride(0), w.tensors[1].stride(0), cdiv(w.k, block_k), split, kwargs)
        self._plans[block_m] = plan
        return plan

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``out``: a contiguous ``[M, N]`` tensor to write the result into (without a residual),
        instead of a new one (the decode step's buffers)."""
        if (residual is not None) != self.add_residual:
            raise ValueError("a residual is " + ("required" if self.add_residual else "not taken") + " here")
        w, shape = self.weight, x.shape
        m = shape[0] if len(shape) == 2 else 0
        if residual is not None:
            out = residual
        if not self._takes(x, m, out):
            _check_x(x, w.k, self.device, self.norm, self.silu)
            if out is None and self.out_dtype is not x.dtype:
                out = torch.empty((m, w.n), dtype=self.out_dtype, device=x.device)
            result = _run(w, x, _path_for(m), _fusion(x, w.k, w.n, self.norm, self.silu, self.bias, residual),
                          out)
            return result if out is None or result is out else out.copy_(result)
        if out is None:
            out = torch.empty((m, w.n), dtype=self.out_dtype, device=x.device)
        launch, args, kwargs = self._gemv(x, m, out)
        launch(*args, **kwargs)
        return out

    def bind(self, x: torch.Tensor, residual: torch.Tensor | None = None, *,
             out: torch.Tensor | None = None) -> Callable[[], object]:
        """This call with its tensors fixed, checked now: a function of nothing that launches it
        on whatever they hold then (a decode step's persistent buffers, llmd.kernels.decode_triton;
        they must keep their shapes). Its result is in ``out`` (or ``residual``)."""
        if (residual is not None) != self.add_residual:
            raise ValueError("a residual is " + ("required" if self.add_residual else "not taken") + " here")
        if residual is not None:
            out = residual
        m = x.shape[0] if x.ndim == 2 else 0
        if out is None or not self._takes(x, m, out):
            return functools.partial(self, x, residual, out=out)  # checked at each call
        launch, args, kwargs = self._gemv(x, m, out)
        return functools.partial(launch, *args, **kwargs)

    def _takes(self, x: torch.Tensor, m: int, out: torch.Tensor | None) -> bool:
        """Whether ``m`` rows of x (and ``out``, unless None) go straight to the bound GEMV."""
        # (dtypes are singletons: `is` is their equality)
        return (0 < m <= GEMV_MAX_M and x.dtype is self.dtype and x.shape[1] == self._width and x.is_contiguous()
                and (out is None or (out.shape == (m, self.weight.n) and out.dtype is self.out_dtype
                                     and out.is_contiguous())))

    def _gemv(self, x: torch.Tensor, m: int, out: torch.Tensor) -> tuple[Callable, tuple, dict]:
        """``(launch, args, kwargs)`` of the GEMV of ``m`` rows of x into ``out``."""
        w = self.weight
        block_m = 1 if m == 1 else GEMV_DOT_BLOCK_M
        launch, part, counters, norm_w, bias, n, k, eps, sw, ss, k_iters, split, kwargs = \
            self._plans.get(block_m) or self._plan(block_m)
        return launch, (x, *w.tensors, out, out if part is None else part, counters, x if norm_w is None else norm_w,
                        x if bias is None else bias, out, m, n, k, eps, x.stride(0), sw, ss, n, n, k_iters,
                        split), kwargs


def fused_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
               dtype: torch.dtype, **fusions) -> FusedMatmul:
    """:class:`FusedMatmul` of an INT4 weight (the arguments of :func:`int4_matmul`) for activations
    of ``dtype``; ``fusions``: ``norm``, ``silu``, ``bias``, ``add_residual``, and ``out_dtype``
    (the result's, default ``dtype``: an fp32 result takes the fp32 sums unrounded, as the LM
    head's logits want)."""
    return FusedMatmul(_int4_weight(packed, scales, mins, group_size), dtype, **fusions)


def fused_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype,
               **fusions) -> FusedMatmul:
    """:class:`FusedMatmul` of an INT8 weight (see :func:`fused_int4`)."""
    return FusedMatmul(_int8_weight(qweight, scales, group_size), dtype, **fusions)
