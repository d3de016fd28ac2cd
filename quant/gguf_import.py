"""GGUF Q8_0 / Q4_0 / Q4_1 blocks as llmd INT8 / INT4 weights, without requantising.

Block layouts (32 weights per block, little endian):
  Q8_0  34 bytes: d (fp16), 32 x int8 q                      w = d * q
  Q4_0  18 bytes: d (fp16), 16 bytes of nibbles               w = d * (q - 8)
  Q4_1  20 bytes: d (fp16), m (fp16), 16 bytes of nibbles     w = d * q + m
In a Q4 block byte ``j`` holds weight ``j`` in its low nibble and weight ``j + 16`` in its high
nibble; llmd packs neighbours (``2i``, ``2i + 1``), so the nibbles are re-packed (a permutation,
lossless); the fp16 scales and mins are kept as they are. The native CPU kernels pair nibbles the
way GGUF does, so a layer bound to them takes the blocks as they are (:class:`Q4Blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmd.kernels import quant_cpu
from llmd.quant.int4 import Int4Weight
from llmd.quant.int8 import Int8Weight

BLOCK = 32


def _blocks(raw: np.ndarray, block_bytes: int) -> torch.Tensor:
    """``[rows, row bytes]`` -> ``[rows, blocks, block_bytes]`` uint8: ``raw`` itself if it is
    writable (the loader reads each tensor into fresh memory), else a copy (a read-only view of a
    file: its pages may be dropped once it is converted)."""
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] % block_bytes:
        raise ValueError(f"expected rows of whole {block_bytes}-byte blocks, got shape {raw.shape}")
    held = raw if raw.flags.writeable and raw.flags.c_contiguous else np.array(raw)
    return torch.from_numpy(held).view(raw.shape[0], raw.shape[1] // block_bytes, block_bytes)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """``[rows, blocks, 2]`` bytes -> ``[rows, blocks]`` fp16."""
    return b.contiguous().view(torch.float16)[..., 0]


def _repack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[rows, blocks, 16]`` GGUF nibble bytes (byte ``j``: weights ``j`` and ``j + 16``) -> llmd's
    packing ``[rows, blocks * 16]`` (byte ``p``: weights ``2p`` and ``2p + 1``), byte-wise: weights
    ``2p, 2p + 1`` are the low nibbles of GGUF bytes ``2p, 2p + 1`` for ``p < 8``, their high nibbles
    of bytes ``2p - 16, 2p - 15`` above. (Unpacking to one byte per weight first took 3x as long.)"""
    even, odd = qs[..., 0::2], qs[..., 1::2]  # [rows, blocks, 8]
    low = (even & 0x0F) | ((odd & 0x0F) << 4)
    high = (even >> 4) | (odd & 0xF0)
    return torch.cat((low, high), dim=-1).reshape(qs.shape[0], -1)


# Rows import_q8_0 moves at once: the only memory it takes beside the blocks.
COMPACT_ROWS = 4096


def import_q8_0(raw: np.ndarray, consume: bool = False) -> Int8Weight:
    """The blocks as llmd's INT8 weight. ``consume`` (the loader's fresh copy of a tensor): the int8
    values are moved down over the fp16 scales in ``raw``'s own memory (row ``r`` to ``r * K``, never
    past where row ``r`` began), a chunk of rows at a time, so no second copy of the weight stands
    beside the blocks (a Llama 3.2 3B's Q8_0 table is 418 MB); the weight keeps that memory, 1/17 of
    it unused, and ``raw`` holds it. Else ``raw`` is left as it was."""
    b = _blocks(raw, 34)
    n, nb = b.shape[0], b.shape[1]
    scales = _fp16(b[..., 0:2])
    if not consume:
        return Int8Weight(b[..., 2:].contiguous().view(torch.int8).reshape(n, -1), scales, BLOCK)
    scales = scales.clone()  # (a view of the blocks when there is one block: the values move over it)
    flat = b.view(-1).view(torch.int8)
    for r0 in range(0, n, COMPACT_ROWS):
        r1 = min(n, r0 + COMPACT_ROWS)
        flat[r0 * nb * BLOCK:r1 * nb * BLOCK].copy_(b[r0:r1, :, 2:].contiguous().view(-1).view(torch.int8))
    return Int8Weight(flat[:n * nb * BLOCK].view(n, nb * BLOCK), scales, BLOCK)


def import_q4_0(raw: np.ndarray) -> Int4Weight:
    return Q4Blocks.of(raw, "Q4_0").to_int4()


def import_q4_1(raw: np.ndarray) -> Int4Weight:
    return Q4Blocks.of(raw, "Q4_1").to_int4()


@dataclass(slots=True)
class Q4Blocks:
    """A GGUF tensor's Q4_0/Q4_1 blocks as the file holds them (``raw [rows, blocks, 18 | 20]``),
    handed to an :class:`~llmd.quant.int4.Int4Linear` as they are: the native kernels' layout is a
    byte permutation of them (:meth:`native_parts`, no nibble moved), so a layer bound to those
    kernels skips llmd's INT4 layout, which is two nibble repackings away (:meth:`to_int4`)."""

    raw: torch.Tensor
    kind: str  # "Q4_0" or "Q4_1"

    @classmethod
    def of(cls, raw: np.ndarray, kind: str) -> Q4Blocks:
        return cls(_blocks(raw, 18 if kind == "Q4_0" else 20), kind)

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.raw.shape[1] * BLOCK

    @property
    def group_size(self) -> int:
        return BLOCK

    def _scales_mins(self) -> tuple[torch.Tensor, torch.Tensor]:
        d = _fp16(self.raw[..., 0:2])
        return d, (-8.0 * d if self.kind == "Q4_0" else _fp16(self.raw[..., 2:4]))  # Q4_0: w = d (q - 8)

    def _nibbles(self) -> torch.Tensor:
        return self.raw[..., 2:] if self.kind == "Q4_0" else self.raw[..., 4:]

    def to_int4(self) -> Int4Weight:
        """llmd.quant's INT4 layout (lossless)."""
        return Int4Weight(_repack_nibbles(self._nibbles()), *self._scales_mins(), BLOCK)

    def native_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(w, scales, mins)`` in the native kernels' layout (kernels/quant_cpu.repack_q4x8: per 8
        rows and block, byte ``32j + 4i + t`` holds row ``i``'s weights ``4j + t`` and ``16 + 4j + t``,
        which is GGUF's byte ``4j + t`` of that row's block); ``mins`` None for Q4_0, whose mins the
        kernels compute (-8 * scale). Needs whole groups of 8 rows."""
        n, nb, size = self.raw.shape
        if n % 8:
            raise ValueError(f"the native layout takes rows in groups of 8, got {n}")
        if self.raw.is_contiguous():  # the blocks as read: the native library moves the bytes
            w = torch.empty(n // 8, nb, 128, dtype=torch.uint8)
            scales = torch.empty(n // 8, nb, 8, dtype=torch.float16)
            mins = torch.empty_like(scales) if self.kind == "Q4_1" else None
            nibbles_at = 2 if self.kind == "Q4_0" else 4
            if quant_cpu.interleave_rows(self.raw, w, n // 8, nb, row=nb * size, block=size, off=nibbles_at, chunks=4) \
                    and quant_cpu.gather_scales(self.raw, scales, row=nb * size, block=size, off=0) \
                    and (mins is None or quant_cpu.gather_scales(self.raw, mins, row=nb * size, block=size, off=2)):
                return w, scales, mins
        w = self._nibbles().reshape(n // 8, 8, nb, 4, 4).permute(0, 2, 3, 1, 4).reshape(n // 8, nb, 128)
        scales, mins = self._scales_mins()
        return (w.contiguous(), quant_cpu.group_scales(scales),
                None if self.kind == "Q4_0" else quant_cpu.group_scales(mins))
