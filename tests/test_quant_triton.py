"""The Triton INT4 / INT8 matmuls, run by the Triton interpreter on the CPU, against the torch
reference ``x.float() @ dequantize(w).T``: both kernels (GEMV and GEMM) at every M, ragged N and K,
fp16 and fp32 scales, symmetric and asymmetric INT4, INT8 per channel and per group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_compile import compile_for_gpu

import llmd.kernels.quant_matmul_triton as qmt
from llmd.quant.int4 import Int4Weight, dequantize_int4, quantize_int4
from llmd.quant.int8 import Int8Weight, dequantize_int8, quantize_int8

PATHS = ("gemv", "gemm")
# max |out - ref| / max |ref|. fp32: summation order only. fp16: x is exact, but the GEMM rounds the
# dequantised tile to fp16 and both round the output (2^-11 each); measured <= 5e-4. A swapped nibble,
# another group's scale and min, or no min is off by 0.7 to 4 (groups differ in scale and offset, see
# `weight`); each of those, put in the kernels, fails these tests.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def dtype_id(value: object) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def weight(n: int, k: int, group_size: int, g: torch.Generator) -> torch.Tensor:
    """Random ``[N, K]`` whose groups differ in scale (log-normal) and offset, so that each group's
    scale and min matter: a kernel reading another group's is far off."""
    w = torch.randn(n, k // group_size, group_size, generator=g)
    w = w * torch.randn(n, k // group_size, 1, generator=g).exp() + torch.randn(n, k // group_size, 1, generator=g)
    return w.reshape(n, k)


# (M, N, K, group size, symmetric, scales dtype, x dtype). Every M, group size, both N not a multiple of
# any BLOCK_N, K = 96 and 160 (not multiples of the 64 GEMM BLOCK_K; INT4 picks BLOCK_K = 32 there).
INT4_CASES = [
    (1, 100, 160, 32, False, torch.float32, torch.float32),
    (1, 72, 256, 128, True, torch.float16, torch.float16),
    (3, 72, 192, 64, True, torch.float16, torch.float32),
    (3, 100, 256, 128, False, torch.float32, torch.float16),
    (3, 40, 32, 32, False, torch.float32, torch.float32),  # K = one group, smaller than any max BLOCK_K
    (17, 100, 256, 128, False, torch.float16, torch.float32),
    (17, 72, 96, 32, True, torch.float32, torch.float16),
    (64, 72, 96, 32, False, torch.float16, torch.float16),
    (64, 100, 128, 64, True, torch.float32, torch.float32),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("m", "n", "k", "group_size", "symmetric", "scale_dtype", "x_dtype"), INT4_CASES, ids=dtype_id)
def test_int4_matmul_matches_reference(path: str, m: int, n: int, k: int, group_size: int, symmetric: bool,
                                       scale_dtype: torch.dtype, x_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * k + group_size)
    qw = quantize_int4(weight(n, k, group_size, g), group_size, symmetric)
    scales, mins = qw.scales.to(scale_dtype), qw.mins.to(scale_dtype)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    ref = x.float() @ dequantize_int4(Int4Weight(qw.packed, scales.float(), mins.float(), group_size)).T
    out = qmt.int4_matmul(x, qw.packed, scales, mins, group_size, path=path)
    assert out.shape == (m, n) and out.dtype == x_dtype
    assert rel_err(out, ref) < TOLERANCE[x_dtype]


# (M, N, K, group size or None for per channel, scales dtype, x dtype). K = 100 and 160 are not
# multiples of BLOCK_K (per channel, K is masked).
INT8_CASES = [
    (1, 100, 100, None, torch.float32, torch.float32),
    (3, 72, 96, 32, torch.float16, torch.float16),
    (17, 72, 160, None, torch.float16, torch.float16),
    (64, 100, 128, 32, torch.float32, torch.float32),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("m", "n", "k", "group_size", "scale_dtype", "x_dtype"), INT8_CASES, ids=dtype_id)
def test_int8_matmul_matches_reference(path: str, m: int, n: int, k: int, group_size: int | None,
                                       scale_dtype: torch.dtype, x_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * k)
    qw = quantize_int8(weight(n, k, group_size or k, g), group_size)
    scales = qw.scales.to(scale_dtype)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    ref = x.float() @ dequantize_int8(Int8Weight(qw.qweight, scales.float(), qw.group_size)).T
    out = qmt.int8_matmul(x, qw.qweight, scales, qw.group_size, path=path)
    assert out.shape == (m, n) and out.dtype == x_dtype
    assert rel_err(out, ref) < TOLERANCE[x_dtype]


def test_bf16_activations_gemv() -> None:
    # GEMV only: the interpreter multiplies the raw bits of bf16 tl.dot operands (triton-lang/triton
    # issue 11584, "not supported yet"), so the GEMM's bf16 path can only be checked on a GPU.
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 128, generator=g).bfloat16()
    q4 = quantize_int4(weight(40, 128, 64, g), 64)
    out = qmt.int4_matmul(x, q4.packed, q4.scales, q4.mins, 64, path="gemv")
    assert out.dtype == torch.bfloat16
    assert rel_err(out, x.float() @ dequantize_int4(q4).T) < TOLERANCE[torch.bfloat16]
    q8 = quantize_int8(weight(40, 128, 128, g))
    out = qmt.int8_matmul(x, q8.qweight, q8.scales, q8.group_size, path="gemv")
    assert rel_err(out, x.float() @ dequantize_int8(q8).T) < TOLERANCE[torch.bfloat16]


def test_default_path_and_strided_x() -> None:
    assert qmt._path_for(1) == "gemv" and qmt._path_for(qmt.GEMV_MAX_M) == "gemv"
    assert qmt._path_for(qmt.GEMV_MAX_M + 1) == "gemm"
    g = torch.Generator().manual_seed(3)
    qw = quantize_int4(weight(40, 64, 32, g), 32)
    for m in (1, 20):  # one per path; x is a column slice (row stride 96), the output is not
        x = torch.randn(m, 96, generator=g)[:, 16:80]
        out = qmt.int4_matmul(x, qw.packed, qw.scales, qw.mins, 32)
        assert rel_err(out, x @ dequantize_int4(qw).T) < TOLERANCE[torch.float32]
    empty = qmt.int4_matmul(torch.zeros(0, 64), qw.packed, qw.scales, qw.mins, 32)
    assert empty.shape == (0, 40)


def test_invalid_inputs_raise() -> None:
    q4 = quantize_int4(torch.randn(8, 64), 32)
    q8 = quantize_int8(torch.randn(8, 64), 32)
    x = torch.randn(2, 64)
    bad_int4 = [
        (dict(x=torch.randn(2, 32)), "input features"),
        (dict(x=torch.randn(1, 2, 64)), "2-D"),
        (dict(x=x.to(torch.int32)), "x must be"),
        (dict(packed=q4.packed.to(torch.int8)), "uint8"),
        (dict(packed=torch.zeros(64, 8, dtype=torch.uint8).T), "contiguous"),
        (dict(scales=q4.scales[:, :1]), "scales must have shape"),
        (dict(mins=q4.mins.double()), "mins must be"),
        (dict(group_size=16), "group size"),
        (dict(group_size=128), "must divide"),
        (dict(path="fast"), "path"),
    ]
    for change, message in bad_int4:
        args = dict(x=x, packed=q4.packed, scales=q4.scales, mins=q4.mins, group_size=32) | change
        with pytest.raises(ValueError, match=message):
            qmt.int4_matmul(**args)
    bad_int8 = [
        (dict(qweight=q8.qweight.to(torch.uint8)), "int8"),
        (dict(scales=q8.scales.T.contiguous().T), "contiguous"),
        (dict(group_size=48), "must divide"),
        (dict(group_size=8, scales=torch.ones(8, 8)), "multiple of 16"),
    ]
    for change, message in bad_int8:
        args = dict(x=x, qweight=q8.qweight, scales=q8.scales, group_size=32) | change
        with pytest.raises(ValueError, match=message):
            qmt.int8_matmul(**args)


# Each kernel compiled for an A100 (see gpu_compile.py): both tl.dot branches of the GEMMs (16-bit
# tensor cores, IEEE fp32).
COMPILE_FOR_GPU = """
import llmd.kernels.quant_matmul_triton as q

common = {"scales_ptr": "*fp16", "N": "i32", "K": "i32",
          "stride_xm": "i32", "stride_xk": "i32", "stride_om": "i32", "stride_on": "i32"}
int4, int8 = dict(common, packed_ptr="*u8", mins_ptr="*fp16"), dict(common, q_ptr="*i8")
gemv = dict(BLOCK_N=q.GEMV_BLOCK_N, BLOCK_K=q.GEMV_MAX_BLOCK_K)
gemm = dict(BLOCK_M=16, BLOCK_N=q.GEMM_BLOCK_N, BLOCK_K=q.GEMM_MAX_BLOCK_K)
kernels = [(q._int4_gemv_kernel, int4, dict(gemv, GROUP_SIZE=128), ["fp16"]),
           (q._int8_gemv_kernel, int8, dict(gemv, GROUP_SIZE=4096), ["fp16"]),
           (q._int4_gemm_kernel, dict(int4, M="i32"), dict(gemm, GROUP_SIZE=64), ["fp16", "fp32"]),
           (q._int8_gemm_kernel, dict(int8, M="i32"), dict(gemm, GROUP_SIZE=64), ["fp16", "fp32"])]
for fn, signature, constexprs, x_dtypes in kernels:
    for x in x_dtypes:
        compile_sm80(fn, dict(signature, x_ptr=f"*{x}", out_ptr=f"*{x}"), constexprs)
"""


def test_kernels_compile_for_a_gpu(tmp_path: Path) -> None:
    compile_for_gpu(COMPILE_FOR_GPU, tmp_path)
