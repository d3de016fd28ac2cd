"""CPU matmuls on INT4 / INT8 weights: the native kernels (kernels/cpu/quant_gemm.c) and torch's.

The native kernels quantise the activations to int8 per block of 32 and take integer dot
products (the way llama.cpp runs its Q4/Q8 formats); :func:`int4_matmul_q8_ref` and
:func:`int8_matmul_q8_ref` are the same arithmetic in torch, the ground truth of the tests and
the path when the native library cannot be built. Measured on this project's machines (AMD EPYC,
2 cores): see benchmarks/quant_matmul_cpu.py.

When there is no native library, torch's packed weight-only kernels below are used instead.

torch ships ``_weight_int4pack_mm_for_cpu`` and ``_weight_int8pack_mm``. Measured on an AMD EPYC
with avx512_bf16 (this project's machines), with bf16 activations and a 3072x576 weight:
M=1: int8 36 us, int4 53 us vs 97 us for a dense bf16 matmul (memory-bound decode gains);
M=16: int8 223 us, int4 301 us vs 134 us dense bf16. With fp32 activations the same kernels are
5-50x slower than dense fp32, so they are used only for bf16 activations; everything else takes
the reference path (dequantise, then a dense matmul), which is also what these are tested against.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from typing import TYPE_CHECKING

import torch

from llmd.kernels.native import library
from llmd.quant.common import unpack_int4

if TYPE_CHECKING:  # llmd.quant.int4 imports this module
    from llmd.quant.int4 import Int4Weight

QK = 32  # activations are quantised per block of this many inputs


def cpu_path(dtype: torch.dtype, in_features: int, packed_ok: bool = True) -> str:
    """Which CPU matmul a quantised layer takes for activations of ``dtype``, fastest first:
    ``packed`` (torch's kernels, bf16 on a CPU with native bf16: they beat ours there, see
    benchmarks/quant_matmul_cpu.py), ``native`` (ours: any CPU with a C compiler; inputs a
    multiple of 32), else ``reference`` (dequantise, then a dense matmul)."""
    if packed_ok and packed_kernels_pay(dtype):
        return "packed"
    # NOTE: LLMD_NATIVE=0 is read here too, not only by library() (decided once per process), so
    # tests of the quantised weights themselves can pin the exact reference path.
    if in_features % QK == 0 and os.environ.get("LLMD_NATIVE", "1") != "0" and library() is not None:
        return "native"
    return "reference"


def _threads() -> int:
    return torch.get_num_threads()


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` fp32 -> int8 ``xq [M, K]``, scales ``xd [M, K/32]``, block sums ``xs [M, K/32]``
    (int32): ``xd = amax / 127`` and ``xq = round(x / xd)`` (half to even; 0 where ``xd`` is 0)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // QK, QK)
    xd = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(xd > 0, 1.0 / xd, torch.zeros_like(xd))
    xq = torch.round(blocks * inv[..., None])
    return xq.to(torch.int8).reshape(m, k), xd, xq.sum(dim=-1).to(torch.int32)


def quantize_activations(x: torch.Tensor, lib: ctypes.CDLL | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_activations_ref` in the native library (bit for bit the same).
    ``lib``: another build of it (tests); the functions below take it too."""
    x = x.float().contiguous()
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.int8)
    xd = torch.empty(m, k // QK, dtype=torch.float32)
    xs = torch.empty(m, k // QK, dtype=torch.int32)
    (lib or library()).llmd_quantize_q8(x.data_ptr(), m, k, xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), _threads())
    return xq, xd, xs


def _block_dots(xq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact integer dot products per block of 32: ``[M, N, K/32]`` (int64 matmul, so no rounding)."""
    m, k = xq.shape
    xb = xq.long().reshape(m, 1, k // QK, 1, QK)
    qb = q.long().reshape(1, q.shape[0], k // QK, QK, 1)
    return (xb @ qb).reshape(m, q.shape[0], k // QK)


def int4_matmul_q8_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                       group_size: int) -> torch.Tensor:
    """``x [M, K] @ W^T`` (fp32) the native kernel's way; torch only, for tests and small shapes."""
    xq, xd, xs = quantize_activations_ref(x.float())
    per_block = group_size // QK
    s = scales.float().repeat_interleave(per_block, dim=1)  # [N, K/32]
    mn = mins.float().repeat_interleave(per_block, dim=1)
    dots = _block_dots(xq, unpack_int4(packed)).float()
    return (dots * s[None] * xd[:, None] + mn[None] * (xd * xs.float())[:, None]).sum(-1)


def int8_matmul_q8_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
                       ) -> torch.Tensor:
    """``x [M, K] @ W^T`` (fp32) the native kernel's way; torch only, for tests and small shapes."""
    xq, xd, _ = quantize_activations_ref(x.float())
    s = scales.float().repeat_interleave(group_size // QK, dim=1)
    return (_block_dots(xq, qweight).float() * s[None] * xd[:, None]).sum(-1)


def int4_matmul_native(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                       group_size: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """:func:`int4_matmul_q8_ref` in the native library: ``[M, N]`` fp32."""
    lib = lib or library()
    xq, xd, xs = quantize_activations(x, lib)
    m, k = xq.shape
    n = packed.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    xm = xd * xs  # the min term's per-block factor
    lib.llmd_int4_gemm(xq.data_ptr(), xd.data_ptr(), xm.data_ptr(), m, k, packed.data_ptr(),
                             scales.data_ptr(), mins.data_ptr(), n, group_size, out.data_ptr(), _threads())
    return out


def int8_matmul_native(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
                       lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """:func:`int8_matmul_q8_ref` in the native library: ``[M, N]`` fp32."""
    lib = lib or library()
    xq, xd, _ = quantize_activations(x, lib)
    m, k = xq.shape
    n = qweight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    lib.llmd_int8_gemm(xq.data_ptr(), xd.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), n,
                             group_size, out.data_ptr(), _threads())
    return out


def packed_kernels_pay(dtype: torch.dtype) -> bool:
    """Whether on this CPU the packed kernels beat dequantise-and-multiply for ``dtype`` activations."""
    from llmd.daemon.device import cpu_has_fast_bf16

    return dtype == torch.bfloat16 and cpu_has_fast_bf16()


def pack_int4_for_cpu(qw: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Our INT4 layout -> torch's CPU int4pack and its ``[K/g, N, 2]`` scales-and-zeros.

    torch dequantises ``(q - 8) * scale + zero``; ours is ``q * scale + min``, so
    ``zero = min + 8 * scale``. torch wants N in multiples of 16: extra rows are zero weights
    (scale 0, zero 0) whose outputs the caller slices off.
    """
    q = unpack_int4(qw.packed).to(torch.int32)
    scales = qw.scales.float()
    zeros = qw.mins.float() + 8 * scales
    pad = -q.shape[0] % 16
    if pad:
        q = torch.cat((q, torch.zeros(pad, q.shape[1], dtype=q.dtype)))
        scales = torch.cat((scales, torch.zeros(pad, scales.shape[1])))
        zeros = torch.cat((zeros, torch.zeros(pad, zeros.shape[1])))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed, torch.stack((scales.t(), zeros.t()), dim=-1).contiguous()


# From this many rows (long prompt chunks) a packed int4 weight is expanded to dense bf16 for the
# matmul: torch's int4 kernel took ~14 ms per layer of SmolLM2 on 512 rows, a dense bf16 matmul ~5 ms.
DENSE_ROWS = 256
# Below DENSE_ROWS the native kernel on torch's packed layout (kernels/cpu/int4pack_gemm.c) is the
# fastest. Medians of 7, in us, for a 3072x576 weight on this project's 2-core machines (a noisy
# day; compare within a row): rows 1: 67 vs torch's kernel 107; 4: 132 vs 190; 8: 220 vs 374;
# 16: 398 vs 724; 32: 781 vs 1438; 64: 906 vs expansion + dense 1087; 128 and up: even with it or
# behind.


def int4pack_to_bf16_t(packed: torch.Tensor, scales_and_zeros: torch.Tensor, n: int, k: int, group_size: int,
                       lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The dense bf16 weight that torch's int4 kernel multiplies by, transposed: ``[k, n]`` (``n``
    padded as packed), so ``x @ it`` is the layer's matmul."""
    out = torch.empty(k, n, dtype=torch.bfloat16)
    sz = scales_and_zeros.to(torch.bfloat16).contiguous()
    (lib or library()).llmd_int4pack_to_bf16_t(packed.data_ptr(), sz.data_ptr(), n, k, group_size, out.data_ptr(),
                                               _threads())
    return out


def int4pack_gemm_usable() -> bool:
    """Whether :func:`int4pack_mm_bf16` runs vectorised here (AVX512-BF16); its portable C build
    computes the same bits, slowly, and is for tests."""
    lib = library()
    return lib is not None and bool(lib.llmd_int4pack_gemm_vectorised())


def int4pack_mm_bf16(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, n: int, group_size: int,
                     lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x [M, K]`` (bf16, ``1 <= M <= 1024``) times an int4 weight in torch's packed layout (one
    :func:`int4pack_layout_known` has confirmed), in the native library (kernels/cpu/int4pack_gemm.c):
    ``[M, n]`` bf16 (``n`` padded as packed, a multiple of 64)."""
    # NOTE: checks, not no-op .to()/.contiguous() calls: each of those is a dispatcher round trip.
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        x = x.to(torch.bfloat16).contiguous()
    sz = scales_and_zeros
    if sz.dtype != torch.bfloat16 or not sz.is_contiguous():
        sz = sz.to(torch.bfloat16).contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.bfloat16)
    status = (lib or library()).llmd_int4pack_gemm_bf16(x.data_ptr(), m, k, packed.data_ptr(), sz.data_ptr(), n,
                                                        group_size, out.data_ptr(), _threads())
    if status != 0:
        raise MemoryError(f"the native int4 matmul could not run ({m}x{k} by {n}x{k}: out of memory?)")
    return out


@cache
def int4pack_layout_known(n: int, k: int, group_size: int) -> bool:
    """Whether :func:`int4pack_to_bf16_t` reads torch's packing of an ``[n, k]`` weight here: checked
    once per shape against torch's own kernel (a multiplication by the identity gives each weight as
    that kernel computes it), as its layout differs between torch's AVX2 and AVX-512 builds."""
    if n % 64 or library() is None:
        return False
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    sz = (torch.rand(k // group_size, n, 2, generator=g) - 0.5).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    by_torch = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k, dtype=torch.bfloat16), packed, group_size, sz)
    return torch.equal(int4pack_to_bf16_t(packed, sz, n, k, group_size), by_torch)


def int4_mm_cpu(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
                ) -> torch.Tensor:
    """``x [M, K] @ W^T`` for a weight prepared by :func:`pack_int4_for_cpu`."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros.to(x.dtype))


def int8_mm_cpu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ W^T`` for an INT8 weight with one scale per output channel (``scales [N]``)."""
    return torch.ops.aten._weight_int8pack_mm(x, qweight, scales.to(x.dtype))
