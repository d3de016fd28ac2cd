"""The LM head held as the checkpoint's own INT8 blocks (GGUF Q8_0), bound to its kernel once.

The head is the largest single weight a decode step reads (SmolLM2-135M: 57 MB in bf16 against
~60 MB for all the INT4 projections), and a GGUF model brings it as Q8_0 blocks: held as they are,
it costs half the bytes of a bf16 copy. The model asks this object for logits, and on the native
kernel a tied model asks it for its token embeddings too (:meth:`Int8Head.rows`: no dense table at
all); which kernel computes them is decided here, at load:

* ``native``: the CPU's INT8 matmul (llmd.kernels.quant_cpu), activations quantised to int8 per
  block of 32 as llama.cpp does (measured on the head of SmolLM2-135M, 2-core Zen 3, one row: 1.7
  ms against 12.6 for the fp32 matmul; 16 rows: 7.3 against 33). The int8 activations move
  log-probabilities by ~0.04 nats on average and a text's perplexity by ~0.01%
  (tests/test_quant_native.py, test_quality.py).
* ``triton``: the Triton INT8 GEMV/GEMM on a GPU, fp32 logits straight from its sums.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from llmd.kernels import int_layout, quant_cpu
from llmd.quant.int8 import Int8Weight

if TYPE_CHECKING:  # triton is imported only where the Triton head is built
    from llmd.kernels.quant_matmul_triton import FusedMatmul

HeadKernel = Literal["native", "triton"]


class Int8Head:
    """``head(hidden [N, hidden_size]) -> [N, vocab] fp32 logits`` on ``kernel``.

    Args:
        q8: the head's blocks.
        kernel: ``native`` or ``triton`` (see the module).
        device, dtype: where the model runs and its activations' dtype (``triton``).
        consume: the native kernel's layout may be made in ``q8``'s own memory (a load's peak is then
            the head once, not twice); ``q8`` is not a weight any more after.
    """

    matmul: quant_cpu.PackedWeight | FusedMatmul  # the kernel's own form of the blocks

    def __init__(self, q8: Int8Weight, kernel: HeadKernel, device: torch.device, dtype: torch.dtype,
                 consume: bool = False) -> None:
        self.kernel = kernel  # fixed for the object's life: use_triton_kernels() builds a new one
        self.group_size = q8.group_size
        if kernel == "native":
            self.matmul = quant_cpu.PackedWeight.from_int8(q8, consume=consume)
        elif kernel == "triton":
            from llmd.kernels.quant_matmul_triton import fused_int8  # imports triton: only where it runs

            self.matmul = fused_int8(q8.qweight.to(device), q8.scales.to(device), q8.group_size, dtype,
                                     out_dtype=torch.float32)
        else:
            raise ValueError(f"an INT8 head runs on the native or the triton kernel, not {kernel!r}")

    @classmethod
    def from_packed(cls, weight: quant_cpu.PackedWeight) -> Int8Head:
        """The head on the native kernel, from blocks already in its layout (a mapped cache,
        llmd.daemon.weights.prepared_cache)."""
        if weight.kind != quant_cpu.Q8X8:
            raise ValueError("an INT8 head is held as INT8 (Q8X8) blocks")
        head = cls.__new__(cls)
        head.kernel, head.group_size, head.matmul = "native", weight.group_size, weight
        return head

    @classmethod
    def for_device(cls, q8: Int8Weight, device: torch.device, dtype: torch.dtype,
                   consume: bool = False) -> Int8Head | None:
        """The head on the kernel for ``device``: Triton on CUDA, native on a CPU where the library
        builds; None where neither runs (the dense copy is the head then). ``consume``: as the
        constructor's, for the native kernel only (``q8`` stays whole otherwise)."""
        if device.type == "cuda":
            return cls(q8, "triton", device, dtype)
        if q8.group_size % quant_cpu.QK == 0 and quant_cpu.cpu_path(torch.float32, q8.shape[1]) == "native":
            return cls(q8, "native", device, dtype, consume=consume)
        return None

    def weight(self) -> Int8Weight:
        """The blocks in llmd.quant's layout (unpacked again from the native kernels' if need be)."""
        m = self.matmul
        if isinstance(m, quant_cpu.PackedWeight):
            return Int8Weight(*quant_cpu.unpack_q8x8(m.w, m.scales, m.n), self.group_size)
        qweight, scales = m.weight.tensors
        return Int8Weight(qweight, scales, self.group_size)

    @property
    def nbytes(self) -> int:
        return self.matmul.nbytes

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows ``ids``, dequantised to fp32 ``[len(ids), hidden]``: a tied model's token
        embeddings, read from the head's blocks (LlamaForCausalLM.embed)."""
        m = self.matmul
        if isinstance(m, quant_cpu.PackedWeight):
            return m.rows(ids)
        qweight, scales = m.weight.tensors
        return int_layout.dequantize_int8(qweight[ids], scales[ids], self.group_size)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.matmul(hidden)
