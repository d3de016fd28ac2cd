"""INT4 weight-only, grouped (32, 64 or 128), asymmetric or symmetric, two values per byte.

One representation serves both: ``w ~= scale * q + min`` with ``q`` in [0, 15] per group.
Symmetric quantisation stores ``min = -8 * scale`` (``w ~= scale * (q - 8)``, as GGUF Q4_0);
asymmetric stores the group's minimum (as GGUF Q4_1). Scales and mins are fp16, as GGUF stores
them: the GGUF import is then exact, and a group costs 4 bytes on top of its nibbles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmd.kernels import int_layout, quant_cpu
from llmd.quant.common import QuantizedLinear, grouped, pack_int4

GROUP_SIZES = int_layout.INT4_GROUP_SIZES
# fp16's smallest normal number: a smaller scale would lose precision to subnormals.
_MIN_SCALE = 2.0 ** -14


@dataclass(slots=True)
class Int4Weight:
    packed: torch.Tensor  # uint8 [N, K / 2]
    scales: torch.Tensor  # fp16 [N, K / group_size]
    mins: torch.Tensor  # fp16 [N, K / group_size]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def nbytes(self) -> int:
        """Bytes as held in memory."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.mins))


def quantize_int4(weight: torch.Tensor, group_size: int = 128, symmetric: bool = False) -> Int4Weight:
    """Quantise ``[N, K]`` to INT4 per group of ``group_size`` input features.

    Scales and mins are rounded to fp16 before ``q`` is chosen, so every weight stays within half a
    step of its stored value.
    """
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}")
    w = weight.float()
    wg = grouped(w, group_size)
    if symmetric:
        scales = (wg.abs().amax(dim=-1) / 7.0).clamp(min=_MIN_SCALE).half().float()
        mins = -8.0 * scales
    else:
        lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
        scales = ((hi - lo) / 15.0).clamp(min=_MIN_SCALE).half().float()
        mins = lo.half().float()
    q = torch.round((wg - mins[..., None]) / scales[..., None]).clamp(0, 15)
    return Int4Weight(pack_int4(q.reshape(w.shape)), scales.half(), mins.half(), group_size)


def dequantize_int4(qw: Int4Weight) -> torch.Tensor:
    """``[N, K]`` fp32 values of ``qw``."""
    return int_layout.dequantize_int4(qw.packed, qw.scales, qw.mins, qw.group_size)


class Int4Linear(QuantizedLinear):
    """``y = x W^T + b`` with an INT4 ``W``, filled row block by row block (:meth:`load_rows`).

    :meth:`prepare` binds the matmul once, when the model is loaded: Triton on CUDA; on the CPU the
    path :func:`llmd.kernels.quant_cpu.cpu_path` picks: ``native`` (our kernels, the weight repacked
    for them), ``packed`` (without our library, bf16 on a CPU with native bf16: torch's int4 layout
    and kernel) or ``reference`` (dequantise, then multiply; also before ``prepare``). One layout
    is held: ours (or a GGUF file's Q4 blocks as they came) until ``prepare``, then the chosen
    kernel's; GGUF blocks become the native layout by a byte permutation, never passing through ours.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, symmetric: bool = False) -> None:
        super().__init__()
        if group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}")
        if in_features % group_size:
            raise ValueError(f"group size {group_size} must divide the input dimension {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.symmetric = group_size, symmetric
        groups = in_features // group_size
        # (empty, never zeroed: a layer loaded from GGUF blocks straight into the native layout never
        # writes them, and a page of them written is resident: zeros made a 3B's scales and mins
        # ~350 MiB of a load's peak; load_weights refuses a checkpoint that leaves rows unloaded)
        self.register_buffer("packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=torch.float16))
        self.register_buffer("mins", torch.empty(out_features, groups, dtype=torch.float16))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.cpu_path = "reference"  # set by prepare()
        self.native: quant_cpu.PackedWeight | None = None  # the `native` path's weight (its tensors are buffers)
        # torch's CPU int4 layout, set by prepare() when that kernel is used.
        self.register_buffer("cpu_packed", None)
        self.register_buffer("cpu_scales_zeros", None)
        self._matmul = self._reference_matmul
        # GGUF Q4 blocks given to load_rows, by first row, kept as the file has them until prepare()
        # (llmd.quant.gguf_import.Q4Blocks): the native layout is a byte permutation of them
        self._staged: list[tuple[int, Any]] = []

    def load_rows(self, start: int, weight: torch.Tensor | Int4Weight) -> None:
        """Fill output rows ``start:start + len(weight)``: an :class:`Int4Weight` with our group size
        is copied as it is (lossless); GGUF Q4 blocks (``Q4Blocks``) are kept as they are until
        :meth:`prepare`; anything else is (re)quantised first."""
        if hasattr(weight, "native_parts"):  # llmd.quant.gguf_import.Q4Blocks
            if weight.group_size == self.group_size and start % 8 == 0 and weight.shape[0] % 8 == 0:
                self._staged.append((start, weight))
                return
            weight = weight.to_int4()
        if isinstance(weight, Int4Weight) and weight.group_size != self.group_size:
            weight = dequantize_int4(weight)
        if not isinstance(weight, Int4Weight):
            weight = quantize_int4(weight, self.group_size, self.symmetric)
        rows = slice(start, start + weight.shape[0])
        self.packed[rows].copy_(weight.packed)
        self.scales[rows].copy_(weight.scales)
        self.mins[rows].copy_(weight.mins)

    def _flush_staged(self) -> None:
        """Staged GGUF blocks into llmd's layout (a layer not bound to the native kernels)."""
        staged, self._staged = self._staged, []
        for start, blocks in staged:
            self.load_rows(start, blocks.to_int4())

    def _native_from_staged(self) -> quant_cpu.PackedWeight | None:
        """The native kernels' weight straight from staged GGUF blocks, if they are every row."""
        if sum(blocks.shape[0] for _, blocks in self._staged) != self.out_features:
            return None
        parts = [blocks.native_parts() for _, blocks in sorted(self._staged, key=lambda s: s[0])]
        self._staged = []

        def cat(ts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(ts) if len(ts) > 1 else ts[0]

        w, scales = cat([p[0] for p in parts]), cat([p[1] for p in parts])
        # Q4_0 parts come without mins (the kernels compute them); beside Q4_1 ones they need theirs
        mins = None if all(m is None for *_, m in parts) else cat([-8.0 * s if m is None else m for _, s, m in parts])
        return quant_cpu.PackedWeight(quant_cpu.Q4X8, self.out_features, self.in_features, self.group_size,
                                      w, scales, mins)

    def weight(self) -> Int4Weight:
        """The weight in llmd.quant's layout (unpacked again from the native kernels' if need be)."""
        self._flush_staged()
        if self.cpu_packed is not None:
            raise RuntimeError("this layer's weight was converted to torch's CPU int4 layout by prepare()")
        if self.native is not None:
            w = self.native
            return Int4Weight(*quant_cpu.unpack_q4x8(w.w, w.scales, w.mins, w.n), self.group_size)
        return Int4Weight(self.packed, self.scales, self.mins, self.group_size)

    def prepare(self, dtype: torch.dtype) -> None:
        """Once loaded: bind the fastest matmul for activations of ``dtype`` (see the class)."""
        if self.packed.device.type == "cuda":
            self.use("triton")
        elif self.cpu_packed is None and self.native is None:
            self.use(quant_cpu.cpu_path(dtype, self.in_features), dtype)

    def use(self, path: str, dtype: torch.dtype = torch.bfloat16) -> None:
        """Hold the weight for the CPU matmul ``path`` and bind it (:meth:`prepare` picks it; tests
        force one). ``dtype``: the activations', for ``packed``. ``triton``: the Triton kernels on
        our layout, as on a GPU (on the CPU only under TRITON_INTERPRET=1: tests, benchmarks)."""
        native = self._native_from_staged() if path == "native" else None
        qw = None if native is not None else self.weight()
        if path == "native":
            self.bind_native(native or quant_cpu.PackedWeight.from_int4(qw))
            return
        held = {"packed": None, "reference": qw, "triton": qw}
        if path == "packed":
            self.native = None
            self.cpu_packed, scales_and_zeros = quant_cpu.pack_int4_for_cpu(qw)
            self.cpu_scales_zeros = scales_and_zeros.to(dtype)
            self._matmul = self._packed_matmul
        elif path == "reference":
            self.native = None
            self._matmul = self._reference_matmul
        elif path == "triton":
            self.native = None
            self._matmul = self._triton_matmul
        else:
            raise ValueError(f"unknown CPU matmul path {path!r}")
        self.cpu_path = path
        # Hold one copy: ours only for the reference (the buffers stay, so state_dict keys do not change).
        kept = held[path]
        for name in ("packed", "scales", "mins"):
            value = getattr(kept, name) if kept is not None else torch.empty(0, dtype=getattr(self, name).dtype)
            setattr(self, name, value)
        for name in ("w", "scales", "mins"):
            self.register_buffer(f"native_{name}", None)

    def bind_native(self, weight: quant_cpu.PackedWeight) -> None:
        """Hold ``weight``, already in the native kernels' layout, and multiply by it (:meth:`use`;
        llmd.daemon.weights.prepared_cache binds a mapped file's this way)."""
        self._staged = []
        self.native = weight
        self._matmul = weight
        self.cpu_path = "native"
        for name in ("packed", "scales", "mins"):  # (kept as buffers, empty: state_dict keys do not change)
            setattr(self, name, torch.empty(0, dtype=getattr(self, name).dtype))
        for name in ("w", "scales", "mins"):
            self.register_buffer(f"native_{name}", getattr(weight, name))

    def _reference_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize_int4(self.weight()).to(x.dtype))

    def _triton_matmul(self, x: torch.Tensor) -> torch.Tensor:
        from llmd.kernels.quant_matmul_triton import int4_matmul

        return int4_matmul(x, self.packed, self.scales, self.mins, self.group_size)

    def _fused_matmul(self, dtype: torch.dtype, **fusions: Any) -> Callable[..., torch.Tensor]:
        from llmd.kernels.quant_matmul_triton import fused_int4

        return fused_int4(self.packed, self.scales, self.mins, self.group_size, dtype, **fusions)

    def _packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        sz = self.cpu_scales_zeros
        out = quant_cpu.int4_mm_cpu(x.to(sz.dtype), self.cpu_packed, self.group_size, sz)
        return out if out.shape[1] == self.out_features else out[:, :self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        out = self._matmul(x2)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)
