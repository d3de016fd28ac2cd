"""The INT4 and INT8 weight layouts every quantised kernel reads, as tensors.

INT4: ``packed`` uint8 ``[N, K/2]``, element ``2i`` of a row in the low nibble of byte ``i`` and
``2i + 1`` in the high one, values 0..15; ``scales`` and ``mins`` ``[N, K/group]``:
``w = q * scale + min`` (symmetric formats store ``min = -8 * scale``). INT8: ``qweight`` int8
``[N, K]`` and ``scales [N, K/group]``: ``w = q * scale``; a group of all K is one scale per output.

The kernels (native CPU, Triton) take these tensors; llmd.quant builds them (``Int4Weight``,
``Int8Weight``) and so depends on this module, never the other way (docs/architecture.md, layers).
"""

from __future__ import annotations

from typing import Protocol

import torch

INT4_GROUP_SIZES = (32, 64, 128)


class Int4Tensors(Protocol):
    """An INT4 weight as the kernels take it (llmd.quant.int4.Int4Weight is one)."""

    packed: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    group_size: int


class Int8Tensors(Protocol):
    """An INT8 weight as the kernels take it (llmd.quant.int8.Int8Weight is one)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    group_size: int


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack values 0..15 two per byte along the last dim: element ``2i`` in the low nibble of byte
    ``i``, element ``2i + 1`` in the high nibble. The last dim must be even."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last dimension, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[..., K/2]`` uint8 -> ``[..., K]`` uint8 values 0..15."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N, K]`` fp32 values of an INT4 weight."""
    q = unpack_int4(packed).float()
    n, k = q.shape
    q = q.reshape(n, k // group_size, group_size)
    return (q * scales.float()[..., None] + mins.float()[..., None]).reshape(n, k)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N, K]`` fp32 values of an INT8 weight."""
    n, k = qweight.shape
    q = qweight.float().reshape(n, k // group_size, group_size)
    return (q * scales.float()[..., None]).reshape(n, k)
