"""The LM head on Q8_0 weights in the native CPU library (kernels/cpu/q8_head.c).

A GGUF model usually stores its output head (or the tied embedding) as Q8_0: one fp16 scale per 32
int8 weights. Loading it into a bf16 matrix rounds every weight (``d * q`` needs up to 19 bits of
mantissa, bf16 has 8) and doubles the bytes a decode step reads. The native kernel reads the Q8_0
blocks as they are and sums in fp32, so it is both faster at small batches and closer to the
checkpoint's values. Its fp32 multiply-adds cost more per extra row than a bf16 matmul's bf16 dot
products, so from MAX_ROWS + 1 rows the model takes its dense bf16 copy instead (SmolLM2-135M's
49152 x 576 head, benchmarks/quant_matmul_cpu.py: 1 row 1.05 ms vs 3.2 ms for the bf16 matmul;
16 rows 8.3 ms vs 5.1 ms; even near 7).

:func:`q8_head_ref` is the same product in torch (dequantise, fp32 matmul): the reference the tests
hold the kernel to, within fp32 rounding (the kernel's order of additions is fixed, see the C).
"""

from __future__ import annotations

import ctypes

import torch

from llmd.kernels.native import library

QK = 32
MAX_K = 8192  # the C's MAX_K
MAX_ROWS = 6  # logits rows up to which this beats the dense bf16 head (see above)


def usable(in_features: int, group_size: int) -> bool:
    """Whether the native kernel takes a Q8 head of this shape here (the library built, groups of 32)."""
    return group_size == QK and in_features % QK == 0 and in_features <= MAX_K and library() is not None


def q8_head_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (scales * qweight)^T`` in fp32: ``qweight [N, K]`` int8, ``scales [N, K/32]`` fp16."""
    n, k = qweight.shape
    weight = (qweight.float().reshape(n, k // QK, QK) * scales.float()[..., None]).reshape(n, k)
    return x.float() @ weight.t()


def q8_head(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, lib: ctypes.CDLL | None = None
            ) -> torch.Tensor:
    """:func:`q8_head_ref` in the native library: logits ``[M, N]`` fp32. ``lib``: another build (tests)."""
    x = x.float().contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    (lib or library()).llmd_q8_head(x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), n, out.data_ptr(),
                                    torch.get_num_threads())
    return out
