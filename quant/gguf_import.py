"""GGUF Q8_0 / Q4_0 / Q4_1 blocks as llmd INT8 / INT4 weights, without requantising.

Block layouts (32 weights per block, little endian):
  Q8_0  34 bytes: d (fp16), 32 x int8 q                      w = d * q
  Q4_0  18 bytes: d (fp16), 16 bytes of nibbles               w = d * (q - 8)
  Q4_1  20 bytes: d (fp16), m (fp16), 16 bytes of nibbles     w = d * q + m
In a Q4 block byte ``j`` holds weight ``j`` in its low nibble and weight ``j + 16`` in its high
nibble; llmd packs neighbours (``2i``, ``2i + 1``), so the nibbles are re-packed (a permutation,
lossless); the fp16 scales and mins are kept as they are.
"""

from __future__ import annotations

import numpy as np
import torch

from llmd.quant.common import pack_int4
from llmd.quant.int4 import Int4Weight
from llmd.quant.int8 import Int8Weight

BLOCK = 32


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] % block_bytes:
        raise ValueError(f"expected rows of whole {block_bytes}-byte blocks, got shape {raw.shape}")
    return raw.reshape(raw.shape[0], raw.shape[1] // block_bytes, block_bytes)


def _fp16(b: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].copy())


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """``[rows, blocks, 16]`` GGUF nibble bytes -> ``[rows, blocks * 32]`` values in weight order."""
    low, high = qs & 0x0F, qs >> 4
    return torch.from_numpy(np.concatenate((low, high), axis=-1).reshape(qs.shape[0], -1).copy())


def import_q8_0(raw: np.ndarray) -> Int8Weight:
    b = _blocks(raw, 34)
    q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(b.shape[0], -1).copy())
    return Int8Weight(q, _fp16(b[..., 0:2]), BLOCK)


def import_q4_0(raw: np.ndarray) -> Int4Weight:
    b = _blocks(raw, 18)
    d = _fp16(b[..., 0:2])
    return Int4Weight(pack_int4(_nibbles(b[..., 2:])), d, -8.0 * d, BLOCK)


def import_q4_1(raw: np.ndarray) -> Int4Weight:
    b = _blocks(raw, 20)
    return Int4Weight(pack_int4(_nibbles(b[..., 4:])), _fp16(b[..., 0:2]), _fp16(b[..., 2:4]), BLOCK)
