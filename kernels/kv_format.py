"""How the paged KV cache stores a token's K or V row for one KV head (issue 23, ``--kv-cache-dtype``).

A cache is ``[num_blocks, block_size, num_kv_heads, row]`` per layer for K and for V. In fp32, bf16
or fp16 a row is the head's ``head_dim`` values. In **int8** it is ``head_dim`` int8 values followed by
their scale, an fp16 in the row's last two bytes (``head_dim + 2`` bytes; the tensor's dtype is
int8): ``value = q * scale`` with ``scale = amax / 127`` of the row rounded up to an fp16 (so no
value needs more than 127 steps: every value's error is within half a step), and
``q = round(x / scale)`` in [-127, 127] (half to even, as torch and the C kernels round).

A scale per (token, KV head) rather than per block: a block's rows are written one step at a time,
so a per-block scale would have to be fixed before its later rows exist; and an outlier token
spoils only its own row. fp16 for the scale (not fp32) keeps a row of the default model's 64 values
at 66 bytes against bf16's 128: 1.94x the tokens in the same memory (an fp32 scale: 68 bytes, 1.88x).
NOTE: keys lose the most (a few channels of a key row are ~10x the rest, and the row's one scale
follows them), so an int8 cache stores keys less a fixed vector per layer and KV head that takes most
of those channels' size away, which attention does not see (llmd.daemon.engine.key_centres; README
"The KV cache" has the measurements). Scales per 32 of a key's values helped about as much and cost
bytes.

Everything that writes or reads a cache goes through the layout named here: the torch reference
(llmd.kernels.attention_ref), the native CPU kernels (kernels/cpu/paged_attention.c and
decode_step.c, which quantise and dequantise bit for bit as :func:`quantize_rows` and
:func:`dequantize_rows`), and the KV pool's sizing.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                   "int8": torch.int8}
SCALE_BYTES = 2  # the fp16 scale after an int8 row's values


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in a cached row: ``head_dim``, plus the scale's bytes for int8."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    return row_width(head_dim, dtype) * dtype.itemsize


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size a cache holds (its last dimension, less an int8 row's scale)."""
    return cache.shape[-1] - SCALE_BYTES if cache.dtype == torch.int8 else cache.shape[-1]


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., head_dim]`` (any float dtype) as int8 cache rows ``[..., head_dim + 2]``."""
    x = x.float()
    want = x.abs().amax(dim=-1, keepdim=True) / 127.0
    scale = want.to(torch.float16)
    # rounded up: the next fp16 where rounding to nearest went below (a positive fp16's bits count up)
    scale = (scale.view(torch.int16) + (scale.float() < want).to(torch.int16)).view(torch.float16)
    s = scale.float()
    q = torch.where(s > 0, torch.round(x / torch.where(s > 0, s, 1.0)), 0.0).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 cache rows ``[..., head_dim + 2]`` as fp32 ``[..., head_dim]``."""
    values, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:]
    return values.float() * scale.contiguous().view(torch.float16).float()


def as_float(rows: torch.Tensor) -> torch.Tensor:
    """Cached rows in a float dtype: int8 ones dequantised to fp32, others as they are."""
    return dequantize_rows(rows) if rows.dtype == torch.int8 else rows


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """New rows ``[..., head_dim]`` in the cache's format."""
    return quantize_rows(x) if cache_dtype == torch.int8 else x.to(cache_dtype)
