"""CPU matmuls on INT4 / INT8 weights: the native kernels (kernels/cpu/quant_gemm.c) and torch's.

The native kernels (any CPU with a C compiler; vectorised with AVX2, VNNI where the CPU has it)
quantise the activations to int8 per block of 32 and take integer dot products, the way llama.cpp
runs its Q4/Q8 formats, on weights repacked once at load so that eight output rows share each
vector (:func:`repack_q4x8`, :func:`repack_q8x8`; :class:`PackedWeight` holds one and multiplies
by it). :func:`qgemm_ref` is the same arithmetic in torch: the ground truth of the tests. They
serve every dtype on every CPU: on an AVX512-BF16 CPU (2-core Zen 4, benchmarks/quant_matmul_cpu.py)
the VNNI build ran 1.0-2.6x faster than torch's packed bf16 int4 kernels from 1 to 512 rows and as
fast as a dense bf16 matmul at 512 rows (without expanding the weight), and bf16 models so take the
one-call decode step too (one stream: 71 -> 192 tok/s there).

Without the library, bf16 models on a CPU with native bf16 take torch's packed weight-only kernels
(``packed``) and others dequantise and multiply (``reference``).
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
import torch

from llmd.kernels import cpu_profile
from llmd.kernels.int_layout import Int4Tensors, Int8Tensors, dequantize_int8, pack_int4, unpack_int4
from llmd.kernels.native import library

QK = 32  # activations are quantised per block of this many inputs
Q4X8, Q8X8 = 1, 2  # the C's enum llmd_weight_kind


def cpu_path(dtype: torch.dtype, in_features: int, packed_ok: bool = True) -> str:
    """Which CPU matmul a quantised layer takes for activations of ``dtype``, fastest first:
    ``native`` (ours: any CPU with a C compiler; inputs a multiple of 32; every dtype),
    ``packed`` (torch's layout and kernels, bf16 on a CPU with native bf16), else ``reference``
    (dequantise, then a dense matmul)."""
    # (through _native(): tests of the quantised weights themselves can pin the exact reference path)
    if in_features % QK == 0 and _native() is not None:
        return "native"
    if packed_ok and packed_kernels_pay(dtype):
        return "packed"
    return "reference"


def _native() -> ctypes.CDLL | None:
    """The native library, None without it or under LLMD_NATIVE=0 (read at each call, not only once
    by library(), so tests can pin the torch paths)."""
    return library() if os.environ.get("LLMD_NATIVE", "1") != "0" else None


def rows_per_pass() -> int | None:
    """Activation rows the native matmuls take per pass over a tile of weights (8 in every build):
    up to this many rows each weight is unpacked once. None without the library."""
    lib = _native()
    return None if lib is None else int(lib.llmd_rows_per_pass())


def _threads() -> int:
    return torch.get_num_threads()


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> int8 ``xq [M, K]``, scales ``xd [M, K/32]`` and ``xm = xd * sum(xq)`` per block
    (fp32): ``xd = amax / 127`` and ``xq = round(x / xd)`` (half to even; 0 where ``xd`` is 0)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // QK, QK)
    xd = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(xd > 0, 1.0 / xd, torch.zeros_like(xd))
    xq = torch.round(blocks * inv[..., None])
    return xq.to(torch.int8).reshape(m, k), xd, xd * xq.sum(dim=-1)


def quantize_activations(x: torch.Tensor, lib: ctypes.CDLL | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_activations_ref` in the native library (bit for bit the same).
    ``lib``: another build of it (tests); the functions below take it too."""
    x = x.float().contiguous()
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.int8)
    xd = torch.empty(m, k // QK, dtype=torch.float32)
    xm = torch.empty(m, k // QK, dtype=torch.float32)
    (lib or library()).llmd_quantize_q8(x.data_ptr(), m, k, xq.data_ptr(), xd.data_ptr(), xm.data_ptr(), _threads())
    return xq, xd, xm


def repack_q4x8(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llmd.quant's INT4 layout (``packed [N, K/2]``, fp16 ``scales``/``mins [N, K/g]``) -> the
    native kernels' (kernels/cpu/quant_gemm.c): rows padded to a multiple of 8 (zero weights), then
    per 8 rows and block of 32 inputs 128 bytes, byte ``32j + 4i + t`` holding row ``i``'s input
    ``4j + t`` in its low nibble and ``16 + 4j + t`` in its high one; scales and mins
    ``[N/8, K/g, 8]``. Lossless (:func:`unpack_q4x8` inverts it)."""
    q = unpack_int4(packed)
    n, k = q.shape
    q, scales, mins = (_pad_rows(t) for t in (q, scales, mins))
    # k = 32 b + 16 h + 4 j + t  ->  [row group, b, j, i, t, h]
    q = q.reshape(-1, 8, k // 32, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    w = (q[..., 0] | (q[..., 1] << 4)).contiguous().reshape(-1, k // 32, 128)
    return w, group_scales(scales), group_scales(mins)


def unpack_q4x8(w: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, n: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`repack_q4x8`: ``(packed, scales, mins)`` in llmd.quant's layout (a
    symmetric weight's mins, None here, as the -8 * scale they stand for)."""
    groups, nb, _ = w.shape
    b = w.reshape(groups, nb, 4, 8, 4)  # [G, b, j, i, t]
    q = torch.stack((b & 0x0F, b >> 4), dim=-1)  # [G, b, j, i, t, h]
    q = q.permute(0, 3, 1, 5, 2, 4).reshape(groups * 8, nb * 32)[:n]
    scales = _ungroup_scales(scales, n)
    return pack_int4(q), scales, -8.0 * scales if mins is None else _ungroup_scales(mins, n)


def symmetric_mins(scales: torch.Tensor, mins: torch.Tensor) -> bool:
    """Whether INT4 ``mins`` are each -8 times their scale (GGUF Q4_0, llmd's symmetric INT4): the
    native kernels then compute them (exactly) and hold none. ``-8.0 * scales`` is exact in fp16."""
    return torch.equal(mins, -8.0 * scales)


def repack_q8x8(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llmd.quant's INT8 layout (``qweight [N, K]``, fp16 ``scales [N, K/g]``) -> the native
    kernels': per 8 rows and block of 32 inputs 256 bytes, byte ``32c + 4i + t`` holding row ``i``'s
    input ``4c + t``; scales ``[N/8, K/g, 8]``. Lossless (:func:`unpack_q8x8`)."""
    w = _q8x8_order(_pad_rows(qweight)).contiguous().reshape(-1, qweight.shape[1] // 32, 256)
    return w.view(torch.uint8), group_scales(_pad_rows(scales))


def _q8x8_order(q: torch.Tensor) -> torch.Tensor:
    """INT8 rows ``[8G, K]`` viewed in the native layout's order ``[G, b, c, i, t]`` (not copied)."""
    return q.reshape(-1, 8, q.shape[1] // 32, 8, 4).permute(0, 2, 3, 1, 4)


# Rows a chunk of repack_q8x8_in_place moves at once (a multiple of 8): the only memory it takes beside
# the weight.
IN_PLACE_ROWS = 4096


def repack_q8x8_in_place(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`repack_q8x8` into ``qweight``'s own memory: the same layout, without a second copy of
    the weight beside it (a Llama 3.2 3B's Q8_0 head is 376 MiB: a load's peak). ``qweight`` is
    consumed (it holds the packed bytes after). Each group of 8 rows packs into the bytes those rows
    held, so the weight is repacked a chunk of rows at a time through one small buffer. Needs whole
    groups of 8 rows and a contiguous weight; anything else is repacked by copy."""
    n, k = qweight.shape
    if n % 8 or not qweight.is_contiguous():
        return repack_q8x8(qweight, scales)
    u8 = qweight.view(torch.uint8)
    if interleave_rows(u8, u8, n // 8, k // 32, row=k, block=32, off=0, chunks=8):
        return u8.view(n // 8, k // 32, 256), group_scales(scales)
    for r0 in range(0, n, IN_PLACE_ROWS):
        chunk = qweight[r0:r0 + IN_PLACE_ROWS]
        chunk.view(-1).copy_(_q8x8_order(chunk).contiguous().view(-1))
    return qweight.view(n // 8, k // 32, 256).view(torch.uint8), group_scales(scales)


def unpack_q8x8(w: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`repack_q8x8`: ``(qweight, scales)`` in llmd.quant's layout."""
    groups, nb, _ = w.shape
    q = w.view(torch.int8).reshape(groups, nb, 8, 8, 4).permute(0, 3, 1, 2, 4)
    return q.reshape(groups * 8, nb * 32)[:n].contiguous(), _ungroup_scales(scales, n)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[0] % 8
    return torch.cat((t, t.new_zeros(pad, *t.shape[1:]))) if pad else t


def group_scales(s: torch.Tensor) -> torch.Tensor:
    """Per-row scales ``[N, K/g]`` (N a multiple of 8) -> the native layout's ``[N/8, K/g, 8]``."""
    if s.dtype == torch.float16 and s.is_contiguous() and s.shape[0] % 8 == 0:
        n, nb = s.shape
        out = torch.empty(n // 8, nb, 8, dtype=torch.float16)
        if gather_scales(s.view(torch.uint8), out, row=2 * nb, block=2, off=0):
            return out
    return s.reshape(-1, 8, s.shape[1]).transpose(1, 2).contiguous()  # [N/8, K/g, 8]


def interleave_rows(src: torch.Tensor, dst: torch.Tensor, groups: int, nb: int, row: int, block: int, off: int,
                    chunks: int) -> bool:
    """The native kernels' interleave of 8 rows by 4-byte chunks (kernels/cpu/repack.c,
    ``llmd_repack_x8``): byte ``32c + 4i + t`` of group ``g``'s block ``b`` in ``dst [groups, nb,
    32 * chunks]`` is byte ``(8g + i) * row + b * block + off + 4c + t`` of ``src`` (uint8, contiguous;
    ``dst`` may be ``src`` when the rows are compact). Returns False, with nothing written, where the
    native library is not there (the callers' torch paths give the same bytes)."""
    lib = _native()
    if lib is None or not (src.is_contiguous() and dst.is_contiguous()):
        return False
    return lib.llmd_repack_x8(src.data_ptr(), groups, nb, row, block, off, chunks, dst.data_ptr(), _threads()) == 0


def gather_scales(src: torch.Tensor, dst: torch.Tensor, row: int, block: int, off: int) -> bool:
    """Per-row fp16 values at ``src``'s bytes ``(8g + i) * row + b * block + off`` into ``dst [groups,
    nb, 8]`` (``llmd_gather_x8_u16``). False, with nothing written, without the native library."""
    lib = _native()
    if lib is None or not (src.is_contiguous() and dst.is_contiguous()):
        return False
    lib.llmd_gather_x8_u16(src.data_ptr(), dst.shape[0], dst.shape[1], row, block, off, dst.data_ptr(), _threads())
    return True


def _ungroup_scales(s: torch.Tensor, n: int) -> torch.Tensor:
    return s.transpose(1, 2).reshape(-1, s.shape[1])[:n].contiguous()


@dataclass(slots=True, eq=False)
class PackedWeight:
    """A quantised weight in the native kernels' layout, and the matmul by it: ``self(x)`` is
    ``x [M, K] @ W^T`` in fp32 (activations quantised to int8 per 32 on the way).

    Attributes:
        kind: :data:`Q4X8` (INT4, ``w = scale * q + min``) or :data:`Q8X8` (INT8, ``w = scale * q``).
        n, k: output and input features.
        group_size: inputs per scale (a multiple of 32).
        w, scales, mins: as :func:`repack_q4x8` / :func:`repack_q8x8` lay them out. ``mins`` is None for
            INT8, and for a symmetric INT4 weight (each min -8 * its scale: GGUF Q4_0), whose
            kernels compute them: the same bits, and 2 bytes less per group of each row.
    """

    kind: int
    n: int
    k: int
    group_size: int
    w: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __post_init__(self) -> None:
        self.check_group(self.k, self.group_size)

    @staticmethod
    def check_group(k: int, group_size: int) -> None:
        """Raises ValueError unless the tiles can walk ``group_size``: they count a group's blocks of
        32 (kernels/cpu/quant_gemm.c: bpg = group / 32), so a smaller or ragged group would make them
        read the wrong scales, or past them, rather than fail."""
        if group_size < QK or group_size % QK or k % group_size:
            raise ValueError(f"the native kernels take groups of a multiple of {QK} inputs dividing "
                             f"in_features {k}, got {group_size}")

    @classmethod
    def from_int4(cls, qw: Int4Tensors) -> PackedWeight:
        n, k = qw.packed.shape[0], 2 * qw.packed.shape[1]
        cls.check_group(k, qw.group_size)  # before repacking (from_int8's may consume its input)
        w, scales, mins = repack_q4x8(qw.packed, qw.scales, qw.mins)
        return cls(Q4X8, n, k, qw.group_size, w, scales, None if symmetric_mins(scales, mins) else mins)

    @classmethod
    def from_int8(cls, qw: Int8Tensors, consume: bool = False) -> PackedWeight:
        """``consume``: repack in ``qw``'s own memory (:func:`repack_q8x8_in_place`); ``qw`` is not
        a weight any more after."""
        n, k = qw.qweight.shape
        cls.check_group(k, qw.group_size)  # before a repack in place destroys qw
        repack = repack_q8x8_in_place if consume else repack_q8x8
        return cls(Q8X8, n, k, qw.group_size, *repack(qw.qweight, qw.scales), None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w, self.scales, self.mins) if t is not None)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64 ``[n]``) of an INT8 weight, dequantised: fp32 ``[n, k]``. A tied
        embedding is read this way from its head's blocks (no dense copy of the table)."""
        if self.kind != Q8X8:
            raise ValueError("rows() reads INT8 (Q8X8) weights")
        lib = library()
        if lib is not None and ids.device.type == "cpu":
            ids = ids.to(torch.int64).contiguous()
            out = torch.empty(ids.shape[0], self.k)
            if lib.llmd_q8x8_rows(self.w.data_ptr(), self.scales.data_ptr(), self.n, self.k, self.group_size,
                                  ids.data_ptr(), ids.shape[0], out.data_ptr()):
                raise IndexError(f"row ids must be in 0..{self.n - 1}")
            return out
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.n):  # (the last group's padding too)
            raise IndexError(f"row ids must be in 0..{self.n - 1}")
        group, row = ids // 8, ids % 8
        q = self.w.view(torch.int8).view(self.w.shape[0], -1, 8, 8, 4)[group, :, :, row, :]  # [n, k/32, 8, 4]
        return dequantize_int8(q.reshape(ids.shape[0], self.k), self.scales[group, :, row], self.group_size)

    def __call__(self, x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        m, k = x.shape
        xq, xd, xm = _activation_scratch(m, k)
        out = torch.empty(m, self.n)
        mins = 0 if self.mins is None else self.mins.data_ptr()
        (lib or library()).llmd_qgemm(self.kind, x.data_ptr(), m, k, xq.data_ptr(), xd.data_ptr(), xm.data_ptr(),
                                      self.w.data_ptr(), self.scales.data_ptr(), mins, self.n, self.group_size,
                                      out.data_ptr(), _threads())
        return out


_scratch = threading.local()


def _activation_scratch(m: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Buffers for ``m x k`` quantised activations (int8 values, scales, scaled sums): one set per
    thread, shared by every PackedWeight (a call needs them only while it runs) and grown to the
    largest call, so a decode step's head allocates only its output, and memory does not grow with
    the number of distinct batch sizes (it did while each weight kept a set per row count)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf[0].numel() < m * k:
        buf = _scratch.buf = (torch.empty(m * k, dtype=torch.int8), torch.empty(m * k // QK), torch.empty(m * k // QK))
    groups = m * (k // QK)
    return buf[0][:m * k].view(m, k), buf[1][:groups].view(m, k // QK), buf[2][:groups].view(m, k // QK)


def qgemm_ref(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """``x [M, K] @ W^T`` (fp32) the native kernels' way, in torch: exact integer dot products per
    block of 32, scaled in fp32 (not in the kernels' order: tests allow fp32 rounding)."""
    xq, xd, xm = quantize_activations_ref(x.float())
    m, k = xq.shape
    if weight.kind == Q4X8:
        packed, scales, mins = unpack_q4x8(weight.w, weight.scales, weight.mins, weight.n)
        q = unpack_int4(packed)
    else:
        q, scales = unpack_q8x8(weight.w, weight.scales, weight.n)
        mins = None
    per_block = weight.group_size // QK
    s = scales.float().repeat_interleave(per_block, dim=1)  # [N, K/32]
    dots = (xq.long().reshape(m, 1, k // QK, 1, QK) @ q.long().reshape(1, weight.n, k // QK, QK, 1))
    out = dots.reshape(m, weight.n, k // QK).float() * s[None] * xd[:, None]
    if mins is not None:
        out = out + mins.float().repeat_interleave(per_block, dim=1)[None] * xm[:, None]
    return out.sum(-1)


def packed_kernels_pay(dtype: torch.dtype) -> bool:
    """Whether on this CPU the packed kernels beat dequantise-and-multiply for ``dtype`` activations."""
    return dtype == torch.bfloat16 and cpu_profile.has_fast_bf16()


def pack_int4_for_cpu(qw: Int4Tensors) -> tuple[torch.Tensor, torch.Tensor]:
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
