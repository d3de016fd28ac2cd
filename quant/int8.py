"""INT8 weight-only, symmetric, per output channel or per group (GGUF Q8_0 is group 32).

``w ~= scale * q`` with ``q`` in [-127, 127] (the import of Q8_0 blocks may hold -128).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmd.quant.common import grouped


@dataclass(slots=True)
class Int8Weight:
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # fp32 [N, K / group_size]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    @property
    def nbytes(self) -> int:
        """Bytes as held in memory."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales))


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> Int8Weight:
    """Symmetric INT8 per output channel (``group_size=None``) or per group of input features."""
    w = weight.float()
    g = group_size or w.shape[1]
    wg = grouped(w, g)
    scales = wg.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    q = torch.round(wg / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.reshape(w.shape), scales, g)


def dequantize_int8(qw: Int8Weight) -> torch.Tensor:
    q = grouped(qw.qweight.float(), qw.group_size)
    return (q * qw.scales[..., None]).reshape(qw.shape)


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with INT8 ``W``. The CPU path dequantises and multiplies in torch (the
    reference every faster kernel is checked against)."""

    def __init__(self, qweight: Int8Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.group_size = qweight.group_size
        self.register_buffer("qweight", qweight.qweight)
        self.register_buffer("scales", qweight.scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from llmd.kernels.quant_cpu import int8_mm_cpu, packed_kernels_pay

        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.group_size == self.in_features and packed_kernels_pay(x):  # the kernel is per channel
            out = int8_mm_cpu(x.reshape(-1, self.in_features), self.qweight, self.scales[:, 0])
            out = out.reshape(*x.shape[:-1], self.out_features)
            return out if bias is None else out + bias
        w = dequantize_int8(Int8Weight(self.qweight, self.scales, self.group_size)).to(x.dtype)
        return F.linear(x, w, bias)
