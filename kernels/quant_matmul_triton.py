"""Triton matmuls that dequantise INT4 / INT8 weights on the fly: ``y = x @ W^T``.

The weights stay in the formats of ``llmd.quant`` (``int4.py``, ``int8.py``); each weight tile is
dequantised in registers (``w = q * scale + min`` for INT4, ``w = q * scale`` for INT8, in fp32)
and multiplied with fp32 accumulation. Two kernels per format:

* GEMV (decode, ``M <= GEMV_MAX_M``): one program per ``(BLOCK_N outputs, row)``, a loop over K
  and a ``tl.sum`` reduction, all in fp32. Decode is memory-bound: the weight bytes are the cost,
  and the rows of a small batch read the same weight tiles, mostly from L2 after the first row.
* GEMM (prefill): ``BLOCK_M x BLOCK_N`` output tiles, a loop over K in ``BLOCK_K`` steps and
  ``tl.dot`` on the dequantised tile cast to the activations' dtype (tensor cores for fp16/bf16;
  fp32 activations get an IEEE fp32 dot, as torch's fp32 matmul, not TF32).

Block sizes are untuned defaults (this project has no GPU to autotune on): ``BLOCK_K`` always
divides the group size, so a K tile never straddles a group and needs one scale (and min) per
output column, loaded once per tile. For INT4 (groups of 32/64/128) that also makes K, a multiple
of the group size, a multiple of ``BLOCK_K``, so INT4 needs no K mask. INT8 per output channel
(one group of K, any K) masks K instead.

Tested on the CPU with the Triton interpreter (``TRITON_INTERPRET=1``) against
``x.float() @ dequantize_int{4,8}(w).T``.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from llmd.quant.int4 import GROUP_SIZES as INT4_GROUP_SIZES

KernelPath = Literal["gemv", "gemm"]

GEMV_MAX_M = 8  # rows up to which the GEMV kernel runs; beyond, a tensor-core tile is cheaper
GEMV_BLOCK_N = 32  # small, so a decode step of a 4096-wide layer still launches 128 programs
GEMV_MAX_BLOCK_K = 128
GEMM_BLOCK_N = 64
GEMM_MAX_BLOCK_M = 64
GEMM_MAX_BLOCK_K = 64
MIN_BLOCK = 16  # tl.dot needs every tile dimension >= 16

_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _path_for(m: int) -> KernelPath:
    """The kernel the matmuls use for ``m`` rows of activations."""
    return "gemv" if m <= GEMV_MAX_M else "gemm"


def _block_k(group_size: int, max_block_k: int) -> int:
    """The largest power of two <= ``max_block_k`` that divides ``group_size`` (a multiple of 16), so
    that a K tile lies in one group and, as K is a multiple of the group size, needs no K mask."""
    block_k = max_block_k
    while group_size % block_k:
        block_k //= 2
    return block_k


@triton.jit
def _int4_gemv_kernel(x_ptr, packed_ptr, scales_ptr, mins_ptr, out_ptr, N, K,
                      stride_xm, stride_xk, stride_om, stride_on,
                      GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    n_groups = K // GROUP_SIZE
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides the group size, hence K: no K mask
        k = k0 + offs_k
        x = tl.load(x_ptr + row * stride_xm + k * stride_xk).to(tl.float32)
        # Element k sits in byte k // 2, low nibble if k is even: each byte is loaded for both of
        # its elements (the second load hits the cache), which keeps the tile in K order.
        byte = tl.load(packed_ptr + offs_n[:, None] * (K // 2) + k[None, :] // 2, mask=mask_n[:, None], other=0)
        q = (byte.to(tl.int32) >> ((k[None, :] % 2) * 4)) & 0xF
        group = k0 // GROUP_SIZE  # the whole tile is in one group
        scale = tl.load(scales_ptr + offs_n * n_groups + group, mask=mask_n, other=0.0).to(tl.float32)
        min_ = tl.load(mins_ptr + offs_n * n_groups + group, mask=mask_n, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * scale[:, None] + min_[:, None]  # [BLOCK_N, BLOCK_K]
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + row * stride_om + offs_n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
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


@triton.jit
def _int8_gemv_kernel(x_ptr, q_ptr, scales_ptr, out_ptr, N, K,
                      stride_xm, stride_xk, stride_om, stride_on,
                      GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    n_groups = K // GROUP_SIZE
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K  # per channel, K need not be a multiple of BLOCK_K
        x = tl.load(x_ptr + row * stride_xm + k * stride_xk, mask=mask_k, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + offs_n[:, None] * K + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0)
        group = k0 // GROUP_SIZE  # the whole tile is in one group
        scale = tl.load(scales_ptr + offs_n * n_groups + group, mask=mask_n, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * scale[:, None]
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + row * stride_om + offs_n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
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


def _check_x(x: torch.Tensor, k: int, device: torch.device) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _ACT_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} input features, the weight {k}")
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
    if path not in ("gemv", "gemm"):
        raise ValueError(f"path must be 'gemv', 'gemm' or None, got {path!r}")
    return path


def _gemm_block_m(m: int) -> int:
    """Rows per GEMM tile: the next power of two of M within [16, GEMM_MAX_BLOCK_M], so a short
    prefill does not compute a mostly masked 64-row tile."""
    return min(GEMM_MAX_BLOCK_M, max(MIN_BLOCK, triton.next_power_of_2(m)))


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                group_size: int, *, path: KernelPath | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T -> [M, N]`` in ``x.dtype`` (fp32 accumulation) for the INT4 weight
    ``W = q * scales + mins`` held as ``packed`` uint8 ``[N, K/2]`` (element ``2i`` in the low
    nibble of byte ``i``), ``scales`` and ``mins`` ``[N, K/group_size]`` (fp32, fp16 or bf16).

    ``path`` forces the GEMV or the GEMM kernel (tests run both at every M); by default
    :func:`_path_for` picks by M.
    """
    if packed.ndim != 2 or packed.dtype != torch.uint8 or not packed.is_contiguous():
        raise ValueError(f"packed must be a contiguous 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"group size {group_size} must divide the input dimension {k}")
    _check_x(x, k, packed.device)
    _check_scales("scales", scales, (n, k // group_size), packed.device)
    _check_scales("mins", mins, (n, k // group_size), packed.device)
    path = _check_path(path, x.shape[0])

    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if path == "gemv":
        grid = (triton.cdiv(n, GEMV_BLOCK_N), m)
        _int4_gemv_kernel[grid](x, packed, scales, mins, out, n, k, x.stride(0), x.stride(1),
                                out.stride(0), out.stride(1), GROUP_SIZE=group_size, BLOCK_N=GEMV_BLOCK_N,
                                BLOCK_K=_block_k(group_size, GEMV_MAX_BLOCK_K))
    else:
        block_m = _gemm_block_m(m)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, GEMM_BLOCK_N))
        _int4_gemm_kernel[grid](x, packed, scales, mins, out, m, n, k, x.stride(0), x.stride(1),
                                out.stride(0), out.stride(1), GROUP_SIZE=group_size, BLOCK_M=block_m,
                                BLOCK_N=GEMM_BLOCK_N, BLOCK_K=_block_k(group_size, GEMM_MAX_BLOCK_K))
    return out


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, *,
                path: KernelPath | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T -> [M, N]`` in ``x.dtype`` (fp32 accumulation) for the INT8 weight
    ``W = q * scales`` held as ``qweight`` int8 ``[N, K]`` and ``scales [N, K/group_size]``;
    ``group_size == K`` is one scale per output channel, otherwise it must be a multiple of 16.

    ``path`` forces the GEMV or the GEMM kernel; by default :func:`_path_for` picks by M.
    """
    if qweight.ndim != 2 or qweight.dtype != torch.int8 or not qweight.is_contiguous():
        raise ValueError(
            f"qweight must be a contiguous 2-D int8 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape
    if group_size < 1 or k % group_size:
        raise ValueError(f"group size {group_size} must divide the input dimension {k}")
    _check_x(x, k, qweight.device)
    _check_scales("scales", scales, (n, k // group_size), qweight.device)
    path = _check_path(path, x.shape[0])
    max_block_k = GEMV_MAX_BLOCK_K if path == "gemv" else GEMM_MAX_BLOCK_K
    if group_size == k:  # per channel: any K, tiles in the one group, K masked
        block_k = max_block_k
    elif group_size % MIN_BLOCK == 0:
        block_k = _block_k(group_size, max_block_k)
    else:
        raise ValueError(f"int8 group size must be the input dimension {k} or a multiple of {MIN_BLOCK}, "
                         f"got {group_size}")

    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if path == "gemv":
        grid = (triton.cdiv(n, GEMV_BLOCK_N), m)
        _int8_gemv_kernel[grid](x, qweight, scales, out, n, k, x.stride(0), x.stride(1),
                                out.stride(0), out.stride(1), GROUP_SIZE=group_size, BLOCK_N=GEMV_BLOCK_N,
                                BLOCK_K=block_k)
    else:
        block_m = _gemm_block_m(m)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, GEMM_BLOCK_N))
        _int8_gemm_kernel[grid](x, qweight, scales, out, m, n, k, x.stride(0), x.stride(1),
                                out.stride(0), out.stride(1), GROUP_SIZE=group_size, BLOCK_M=block_m,
                                BLOCK_N=GEMM_BLOCK_N, BLOCK_K=block_k)
    return out
