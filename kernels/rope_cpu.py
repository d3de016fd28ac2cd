"""Rotary embedding in the native CPU library (kernels/cpu/rope.c): one call per q or k, in place,
instead of six small torch ops, which at batch 1 cost more in dispatch than in arithmetic.

:func:`llmd.daemon.models.layers.apply_rope` calls :func:`rope_` when :func:`usable` says so, else
its torch code (``rope_torch``): the reference, which this matches bit for bit.
"""

from __future__ import annotations

import ctypes

import torch

from llmd.kernels.native import library

DTYPES = (torch.float32, torch.bfloat16)


def usable(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether :func:`rope_` takes ``x`` ``[T, heads, head_dim]`` here: a CPU fp32/bf16 tensor whose
    heads are contiguous within each token row, ``cos`` of its dtype, and the library built."""
    return (x.device.type == "cpu" and x.dtype in DTYPES and cos.dtype == x.dtype and x.dim() == 3
            and x.stride(2) == 1 and x.stride(1) == x.shape[2] and library() is not None)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` ``[T, heads, head_dim]`` in place (rows may be strided, as q/k views
    of a fused projection are); ``cos``/``sin`` ``[T, head_dim]`` contiguous. Returns ``x``."""
    tokens, heads, head_dim = x.shape
    (lib or library()).llmd_rope(x.data_ptr(), tokens, heads, head_dim, x.stride(0), cos.data_ptr(), sin.data_ptr(),
                                 int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return x
