"""INT4 weight-only, grouped (32, 64 or 128), asymmetric or symmetric, two values per byte.

One representation serves both: ``w ~= scale * q + min`` with ``q`` in [0, 15] per group.
Symmetric quantisation stores ``min = -8 * scale`` (``w ~= scale * (q - 8)``, as GGUF Q4_0);
asymmetric stores the group's minimum (as GGUF Q4_1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmd.quant.common import grouped, pack_int4, unpack_int4

GROUP_SIZES = (32, 64, 128)


@dataclass(slots=True)
class Int4Weight:
    packed: torch.Tensor  # uint8 [N, K / 2]
    scales: torch.Tensor  # fp32 [N, K / group_size]
    mins: torch.Tensor  # fp32 [N, K / group_size]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def nbytes(self) -> int:
        """Bytes as held in memory."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.mins))


def quantize_int4(weight: torch.Tensor, group_size: int = 128, symmetric: bool = False) -> Int4Weight:
    """Quantise ``[N, K]`` to INT4 per group of ``group_size`` input features."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}")
    w = weight.float()
    wg = grouped(w, group_size)
    if symmetric:
        scales = wg.abs().amax(dim=-1).clamp(min=1e-12) / 7.0
        mins = -8.0 * scales
    else:
        lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
        scales = ((hi - lo) / 15.0).clamp(min=1e-12)
        mins = lo
    q = torch.round((wg - mins[..., None]) / scales[..., None]).clamp(0, 15)
    return Int4Weight(pack_int4(q.reshape(w.shape)), scales, mins, group_size)


def dequantize_int4(qw: Int4Weight) -> torch.Tensor:
    q = grouped(unpack_int4(qw.packed).float(), qw.group_size)
    return (q * qw.scales[..., None] + qw.mins[..., None]).reshape(qw.shape)


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with INT4 ``W``; torch reference path (dequantise, then multiply)."""

    def __init__(self, qweight: Int4Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.group_size = qweight.group_size
        self.register_buffer("packed", qweight.packed)
        self.register_buffer("scales", qweight.scales)
        self.register_buffer("mins", qweight.mins)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

        self._cpu_pack: tuple[torch.Tensor, torch.Tensor] | None = None  # built on first use

    def weight(self) -> Int4Weight:
        return Int4Weight(self.packed, self.scales, self.mins, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from llmd.kernels.quant_cpu import int4_mm_cpu, pack_int4_for_cpu, packed_kernels_pay

        bias = None if self.bias is None else self.bias.to(x.dtype)
        if packed_kernels_pay(x):
            if self._cpu_pack is None:
                self._cpu_pack = pack_int4_for_cpu(self.weight())
            out = int4_mm_cpu(x.reshape(-1, self.in_features), self._cpu_pack[0], self.group_size, self._cpu_pack[1])
            out = out[:, :self.out_features].reshape(*x.shape[:-1], self.out_features)
            return out if bias is None else out + bias
        return F.linear(x, dequantize_int4(self.weight()).to(x.dtype), bias)
