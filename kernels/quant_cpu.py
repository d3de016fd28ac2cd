"""CPU matmuls on INT4 / INT8 weights through torch's packed weight-only kernels.

torch ships ``_weight_int4pack_mm_for_cpu`` and ``_weight_int8pack_mm``. Measured on an AMD EPYC
with avx512_bf16 (this project's machines), with bf16 activations and a 3072x576 weight:
M=1: int8 36 us, int4 53 us vs 97 us for a dense bf16 matmul (memory-bound decode gains);
M=16: int8 223 us, int4 301 us vs 134 us dense bf16. With fp32 activations the same kernels are
5-50x slower than dense fp32, so they are used only for bf16 activations; everything else takes
the reference path (dequantise, then a dense matmul), which is also what these are tested against.
"""

from __future__ import annotations

import torch

from llmd.quant.common import unpack_int4
from llmd.quant.int4 import Int4Weight


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


def int4_mm_cpu(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
                ) -> torch.Tensor:
    """``x [M, K] @ W^T`` for a weight prepared by :func:`pack_int4_for_cpu`."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros.to(x.dtype))


def int8_mm_cpu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ W^T`` for an INT8 weight with one scale per output channel (``scales [N]``)."""
    return torch.ops.aten._weight_int8pack_mm(x, qweight, scales.to(x.dtype))
