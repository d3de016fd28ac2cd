"""Helpers shared by the quantisation schemes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from llmd.kernels.int_layout import pack_int4, unpack_int4  # noqa: F401 (the INT4 packing, re-exported)


def check_group_size(in_features: int, group_size: int) -> None:
    if group_size < 1 or in_features % group_size:
        raise ValueError(f"group size {group_size} must divide the input dimension {in_features}")


def grouped(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N, K]`` -> ``[N, K / group_size, group_size]`` (a view)."""
    n, k = weight.shape
    check_group_size(k, group_size)
    return weight.reshape(n, k // group_size, group_size)


class QuantizedLinear(nn.Module):
    """What the INT4 and INT8 Linears share: built empty from their shape
    ``(in_features, out_features, group_size, bias, dtype)``, filled by ``load_rows``."""

    in_features: int
    out_features: int

    def load_rows(self, start: int, weight: Any) -> None:
        raise NotImplementedError

    def bind_native(self, weight: Any) -> None:
        """Hold ``weight`` (a ``llmd.kernels.quant_cpu.PackedWeight``, already in the native kernels'
        layout) and multiply by it."""
        raise NotImplementedError

    def bind_fused(self, dtype: torch.dtype, *, norm: tuple[torch.Tensor, float] | None = None, silu: bool = False,
                   add_residual: bool = False) -> Callable[..., torch.Tensor]:
        """This layer on the Triton matmuls with the decode step's fusions fixed (llmd.kernels.
        decode_triton), for activations of ``dtype``: an RMSNorm (``norm=(weight, eps)``) or
        ``SiLU(gate) * up`` (``silu``) applied to x first, the bias added, and with ``add_residual``
        the result added into the ``residual`` the call takes (in place). The ``triton`` path only."""
        if getattr(self, "cpu_path", None) != "triton":
            raise RuntimeError(f"bind_fused() takes the Triton path; this layer is on {self.cpu_path!r}")
        return self._fused_matmul(dtype, norm=norm, silu=silu, bias=getattr(self, "bias", None),
                                  add_residual=add_residual)

    def _fused_matmul(self, dtype: torch.dtype, **fusions: Any) -> Callable[..., torch.Tensor]:
        """llmd.kernels.quant_matmul_triton's FusedMatmul of this layer's weight."""
        raise NotImplementedError

    @classmethod
    def from_weight(cls, qweight: Any, bias: torch.Tensor | None = None) -> QuantizedLinear:
        """A layer holding ``qweight`` (an ``Int4Weight`` / ``Int8Weight``) as it is."""
        n, k = qweight.shape
        dtype = torch.float32 if bias is None else bias.dtype
        layer = cls(k, n, qweight.group_size, bias is not None, dtype)
        layer.load_rows(0, qweight)
        if bias is not None:
            layer.bias.data.copy_(bias)
        return layer
