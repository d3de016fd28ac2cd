"""INT8 weight-only, symmetric, per output channel or per group (GGUF Q8_0 is group 32).

``w ~= scale * q`` with ``q`` in [-127, 127] (the import of Q8_0 blocks may hold -128). Scales are
fp16, as GGUF stores them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmd.kernels import int_layout, quant_cpu
from llmd.quant.common import QuantizedLinear, check_group_size, grouped

_MIN_SCALE = 2.0 ** -14  # fp16's smallest normal number


@dataclass(slots=True)
class Int8Weight:
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # fp16 [N, K / group_size]
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
    scales = (wg.abs().amax(dim=-1) / 127.0).clamp(min=_MIN_SCALE).half().float()
    q = torch.round(wg / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.reshape(w.shape), scales.half(), g)


def dequantize_int8(qw: Int8Weight) -> torch.Tensor:
    """``[N, K]`` fp32 values of ``qw``."""
    return int_layout.dequantize_int8(qw.qweight, qw.scales, qw.group_size)


class Int8Linear(QuantizedLinear):
    """``y = x W^T + b`` with an INT8 ``W``, filled row block by row block (:meth:`load_rows`).

    ``group_size=None`` means one scale per output channel. :meth:`prepare` binds the matmul once
    the model is loaded: Triton on CUDA; on the CPU the path
    :func:`llmd.kernels.quant_cpu.cpu_path` picks: ``native`` (our kernels, the weight repacked for
    them), ``packed`` (torch's int8 kernel: per-channel weights, bf16 on a CPU with native bf16) or
    ``reference`` (dequantise, then multiply; also before ``prepare``).
    """

    def __init__(self, in_features: int, out_features: int, group_size: int | None = None, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        group_size = group_size or in_features
        check_group_size(in_features, group_size)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        # (empty, never zeroed, as Int4Linear's: a page written is resident, and a load bound to a mapped
        # weights cache never writes them; load_weights refuses a checkpoint that leaves rows unloaded)
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, in_features // group_size, dtype=torch.float16))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.cpu_path = "reference"  # set by prepare()
        self.native: quant_cpu.PackedWeight | None = None  # the `native` path's weight (its tensors are buffers)
        self._matmul = self._reference_matmul

    def load_rows(self, start: int, weight: torch.Tensor | Int8Weight) -> None:
        """Fill output rows ``start:start + len(weight)``: an :class:`Int8Weight` with our group size
        is copied as it is (lossless); anything else is (re)quantised first."""
        if isinstance(weight, Int8Weight) and weight.group_size != self.group_size:
            weight = dequantize_int8(weight)
        if not isinstance(weight, Int8Weight):
            weight = quantize_int8(weight, self.group_size)
        rows = slice(start, start + weight.shape[0])
        self.qweight[rows].copy_(weight.qweight)
        self.scales[rows].copy_(weight.scales)

    def weight(self) -> Int8Weight:
        """The weight in llmd.quant's layout (unpacked again from the native kernels' if need be)."""
        if self.native is not None:
            return Int8Weight(*quant_cpu.unpack_q8x8(self.native.w, self.native.scales, self.native.n),
                              self.group_size)
        return Int8Weight(self.qweight, self.scales, self.group_size)

    def prepare(self, dtype: torch.dtype) -> None:
        """Once loaded: bind the fastest matmul for activations of ``dtype`` (see the class)."""
        if self.qweight.device.type == "cuda":
            self.use("triton")
        elif self.native is None:
            self.use(quant_cpu.cpu_path(dtype, self.in_features, packed_ok=self.group_size == self.in_features))

    def use(self, path: str) -> None:
        """Hold the weight for the CPU matmul ``path`` and bind it (:meth:`prepare` picks it; tests
        force one). ``triton``: the Triton kernels on our layout, as on a GPU (on the CPU only under
        TRITON_INTERPRET=1: tests, benchmarks)."""
        qw = self.weight()
        if path == "native":
            self.bind_native(quant_cpu.PackedWeight.from_int8(qw))
            return
        if path not in ("packed", "reference", "triton"):
            raise ValueError(f"unknown CPU matmul path {path!r}")
        self.native = None
        self.qweight, self.scales = qw.qweight, qw.scales
        self._matmul = {"packed": self._packed_matmul, "reference": self._reference_matmul,
                        "triton": self._triton_matmul}[path]
        self.cpu_path = path
        for name in ("w", "scales"):
            self.register_buffer(f"native_{name}", None)

    def bind_native(self, weight: quant_cpu.PackedWeight) -> None:
        """Hold ``weight``, already in the native kernels' layout, and multiply by it (:meth:`use`;
        llmd.daemon.weights.prepared_cache binds a mapped file's this way)."""
        self.native = weight
        self._matmul = weight
        self.cpu_path = "native"
        self.qweight, self.scales = (torch.empty(0, dtype=t.dtype) for t in (self.qweight, self.scales))
        for name in ("w", "scales"):
            self.register_buffer(f"native_{name}", getattr(weight, name))

    def _reference_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize_int8(self.weight()).to(x.dtype))

    def _triton_matmul(self, x: torch.Tensor) -> torch.Tensor:
        from llmd.kernels.quant_matmul_triton import int8_matmul

        return int8_matmul(x, self.qweight, self.scales, self.group_size)

    def _fused_matmul(self, dtype: torch.dtype, **fusions: Any) -> Callable[..., torch.Tensor]:
        from llmd.kernels.quant_matmul_triton import fused_int8

        return fused_int8(self.qweight, self.scales, self.group_size, dtype, **fusions)

    def _packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return quant_cpu.int8_mm_cpu(x, self.qweight, self.scales[:, 0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        out = self._matmul(x2)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)
