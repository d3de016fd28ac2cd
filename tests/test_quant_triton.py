"""The Triton INT4 / INT8 matmuls, run by the Triton interpreter on the CPU, against the torch
reference ``x.float() @ dequantize(w).T``: both kernels (GEMV and GEMM) at every M, ragged N and K,
fp16 and fp32 scales, symmetric and asymmetric INT4, INT8 per channel and per group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_compile import compile_for_gpu

import llmd.kernels.quant_matmul_triton as qmt
from llmd.kernels.launch import arrival_counters
from llmd.quant.int4 import Int4Weight, dequantize_int4, quantize_int4
from llmd.quant.int8 import Int8Weight, dequantize_int8, quantize_int8

PATHS = ("gemv", "gemm", "dense")
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
# any BLOCK_N, K = 96 and 160 (not multiples of the GEMV's 128-wide K tile: it falls back to 32 there).
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
    # The GEMVs' paths without tl.dot only (one row): the interpreter multiplies the raw bits of bf16
    # tl.dot operands (triton-lang/triton issue 11584, "not supported yet"), so the GEMMs' and the
    # GEMVs' 2..16-row bf16 paths can only be checked on a GPU (their fp16 and fp32 twins run here).
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 128, generator=g).bfloat16()
    q4 = quantize_int4(weight(40, 128, 64, g), 64)
    out = qmt.int4_matmul(x[:1], q4.packed, q4.scales, q4.mins, 64, path="gemv")
    assert out.dtype == torch.bfloat16
    assert rel_err(out, x[:1].float() @ dequantize_int4(q4).T) < TOLERANCE[torch.bfloat16]
    q8 = quantize_int8(weight(40, 128, 128, g))
    out = qmt.int8_matmul(x[:1], q8.qweight, q8.scales, q8.group_size, path="gemv")
    assert rel_err(out, x[:1].float() @ dequantize_int8(q8).T) < TOLERANCE[torch.bfloat16]


def test_default_path_and_strided_x() -> None:
    assert qmt._path_for(1) == "gemv" and qmt._path_for(qmt.GEMV_MAX_M) == "gemv"
    assert qmt._path_for(qmt.GEMV_MAX_M + 1) == "gemm" and qmt._path_for(qmt.DENSE_MIN_M) == "gemm"
    assert qmt._path_for(qmt.DENSE_MIN_M + 1) == "dense"
    g = torch.Generator().manual_seed(3)
    qw = quantize_int4(weight(40, 64, 32, g), 32)
    for m in (1, 20, 200):  # one per path; x is a column slice (row stride 96), the output is not
        x = torch.randn(m, 96, generator=g)[:, 16:80]
        out = qmt.int4_matmul(x, qw.packed, qw.scales, qw.mins, 32)
        assert rel_err(out, x @ dequantize_int4(qw).T) < TOLERANCE[torch.float32]
    empty = qmt.int4_matmul(torch.zeros(0, 64), qw.packed, qw.scales, qw.mins, 32)
    assert empty.shape == (0, 40)


def test_dense_path_dequantises_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qmt, "DENSE_CHUNK", 64 * 7)  # 7 weight rows at a time: 6 chunks, the last short
    g = torch.Generator().manual_seed(5)
    x = torch.randn(130, 64, generator=g)
    q4 = quantize_int4(weight(40, 64, 32, g), 32)
    out = qmt.int4_matmul(x, q4.packed, q4.scales, q4.mins, 32, path="dense")
    assert out.shape == (130, 40) and rel_err(out, x @ dequantize_int4(q4).T) < TOLERANCE[torch.float32]
    q8 = quantize_int8(weight(40, 64, 64, g))
    out = qmt.int8_matmul(x, q8.qweight, q8.scales, q8.group_size, path="dense")
    assert rel_err(out, x @ dequantize_int8(q8).T) < TOLERANCE[torch.float32]


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


def _rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


FUSIONS = ("norm", "silu", "bias+residual", "norm+bias+residual")
# bf16 in the interpreter: its fp32 -> bf16 casts truncate (triton.runtime.interpreter's cast_impl
# passes no rounding mode; a GPU rounds to nearest), a bias of up to 2^-8 toward zero at every
# rounding, and a fused layer rounds three or four times in a row (measured: up to 0.0201).
FUSED_TOLERANCE = TOLERANCE | {torch.bfloat16: 4e-2}
# What a fused call without its fusion is off by, at least: 7x the loosest tolerance above.
CANARY = 0.3


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize(("fmt", "m", "x_dtype"), [("int4", 1, torch.float32), ("int4", 3, torch.float16),
                                                   ("int8", 1, torch.float16), ("int8", 5, torch.float32),
                                                   ("int4", 1, torch.bfloat16)], ids=dtype_id)
def test_fused_prologue_and_epilogue_match_the_unfused_layer(path: str, fusion: str, fmt: str, m: int,
                                                             x_dtype: torch.dtype) -> None:
    """The decode step's fusions (issue 19): the RMSNorm before qkv and gate/up, SiLU x up before
    down, the bias and the residual add after a projection, in the GEMV's one launch (split-K
    here: N is small), as the separate kernels on the other paths, all against the torch layer."""
    if path != "gemv" and x_dtype == torch.bfloat16:
        pytest.skip("bf16 tl.dot does not run in the interpreter (triton#11584)")
    n, k = 72, 256
    g = torch.Generator().manual_seed(len(fusion) * 31 + m)
    w = weight(n, k, 64, g)
    if fmt == "int4":
        qw = quantize_int4(w, 64)
        w_ref = dequantize_int4(qw).to(x_dtype)
        run = lambda x, **kw: qmt.int4_matmul(x, qw.packed, qw.scales, qw.mins, 64, path=path, **kw)
    else:
        qw = quantize_int8(w, 64)
        w_ref = dequantize_int8(qw).to(x_dtype)
        run = lambda x, **kw: qmt.int8_matmul(x, qw.qweight, qw.scales, 64, path=path, **kw)
    silu = fusion == "silu"
    x = (torch.randn(m, 2 * k if silu else k, generator=g) * 3).to(x_dtype)
    norm_w = torch.randn(k, generator=g).to(x_dtype)
    bias = torch.randn(n, generator=g).to(x_dtype)
    residual = (torch.randn(m, n, generator=g) * 300).to(x_dtype)  # larger than the product: the canary fails
    kwargs, x_ref = {}, x
    if fusion.startswith("norm"):
        kwargs["norm"] = (norm_w, 1e-5)
        x_ref = _rms_norm_ref(x, norm_w, 1e-5)
    if silu:
        kwargs["silu"] = True
        x_ref = (torch.nn.functional.silu(x[:, :k]) * x[:, k:]).to(x_dtype)
    want = torch.nn.functional.linear(x_ref.float(), w_ref.float()).to(x_dtype)
    if "bias" in fusion:
        kwargs |= dict(bias=bias, residual=residual.clone())
        want = residual + (want + bias)
    got = run(x, **kwargs)
    assert got.shape == (m, n) and got.dtype == x_dtype
    if "residual" in fusion:
        assert got.data_ptr() == kwargs["residual"].data_ptr(), "the residual is updated in place"
    assert rel_err(got, want.float()) < FUSED_TOLERANCE[x_dtype]
    # Canary: the plain product, without the fusion, is far from the fused layer's result.
    assert rel_err(run(x[:, :k]), want.float()) > CANARY


def test_fused_arguments_are_checked() -> None:
    g = torch.Generator().manual_seed(5)
    qw = quantize_int4(weight(40, 64, 32, g), 32)
    x = torch.randn(2, 64, generator=g)
    run = lambda x, **kw: qmt.int4_matmul(x, qw.packed, qw.scales, qw.mins, 32, **kw)
    bad = [
        (dict(norm=(torch.ones(64), 1e-5), silu=True), "one prologue"),  # checked before the widths
        (dict(norm=(torch.ones(32), 1e-5)), "norm weight must be"),
        (dict(norm=(torch.ones(64).half(), 1e-5)), "norm weight must be"),
        (dict(bias=torch.ones(41)), "bias must be"),
        (dict(residual=torch.ones(2, 40).half()), "residual must be"),
        (dict(residual=torch.ones(40, 2).T), "contiguous"),
        (dict(silu=True), "input features"),  # silu wants x [M, 2K]
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            run(x, **kwargs)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_fused_matmul_binds_what_int4_matmul_does(fmt: str) -> None:
    """FusedMatmul (the decode step's projections, checked once): at every row count the result of
    int4_matmul/int8_matmul with the same fusions, bit for bit (the same kernel runs: the GEMV up
    to 16 rows, the GEMM beyond), written into ``out`` when given."""
    g = torch.Generator().manual_seed(21)
    n, k = 72, 128
    if fmt == "int4":
        qw = quantize_int4(weight(n, k, 32, g), 32)
        tensors = (qw.packed, qw.scales, qw.mins, 32)
        bind, matmul = qmt.fused_int4, qmt.int4_matmul
    else:
        qw = quantize_int8(weight(n, k, 32, g), 32)
        tensors = (qw.qweight, qw.scales, 32)
        bind, matmul = qmt.fused_int8, qmt.int8_matmul
    norm = (torch.randn(k, generator=g), 1e-6)
    bias = torch.randn(n, generator=g)
    qkv_like = bind(*tensors, torch.float32, norm=norm, bias=bias)
    down_like = bind(*tensors, torch.float32, silu=True, add_residual=True)
    for m in (1, 5, 16, 17):
        x = torch.randn(m, k, generator=g)
        want = matmul(x, *tensors, norm=norm, bias=bias)
        assert torch.equal(qkv_like(x), want)
        out = torch.empty(m, n)
        assert qkv_like(x, out=out) is out and torch.equal(out, want)
        gate_up = torch.randn(m, 2 * k, generator=g)
        residual = torch.randn(m, n, generator=g)
        want = matmul(gate_up, *tensors, silu=True, residual=residual.clone())
        got = residual.clone()
        assert down_like(gate_up, got) is got and torch.equal(got, want)
        assert rel_err(got, residual) > CANARY  # the product was added
    with pytest.raises(ValueError, match="residual is required"):
        down_like(torch.randn(1, 2 * k))
    with pytest.raises(ValueError, match="residual is not taken"):
        qkv_like(torch.randn(1, k), torch.randn(1, n))
    with pytest.raises(ValueError, match="input features"):
        qkv_like(torch.randn(1, k + 2))
    with pytest.raises(ValueError, match="norm weight must be"):
        bind(*tensors, torch.float16, norm=norm)  # an fp32 norm weight for fp16 activations


def test_int4_gemv_split_k_is_deterministic_and_resets_its_counters() -> None:
    """Split-K: the last program of a column block to arrive adds the splits in order, so two
    launches agree bit for bit, and it zeroes the block's arrival counter for the next launch (a
    counter left behind would make the next launch's sums come out of the wrong program)."""
    g = torch.Generator().manual_seed(11)
    qw = quantize_int4(weight(100, 512, 32, g), 32)
    x = torch.randn(1, 512, generator=g)
    block_k, split = qmt.gemv_plan(100, 512, x.device)
    assert split > 1, "the test needs split-K"
    first = qmt.int4_matmul(x, qw.packed, qw.scales, qw.mins, 32, path="gemv")
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0
    second = qmt.int4_matmul(x, qw.packed, qw.scales, qw.mins, 32, path="gemv")
    assert torch.equal(first, second)
    assert rel_err(first, x @ dequantize_int4(qw).T) < TOLERANCE[torch.float32]


def test_int4_gemv_without_split_k() -> None:
    # 264 column blocks: enough programs without splitting K (the kernel's one-pass store).
    n = qmt.GEMV_PROGRAMS_PER_SM * qmt.DEFAULT_SMS * qmt.GEMV_BLOCK_N
    g = torch.Generator().manual_seed(12)
    qw = quantize_int4(weight(n, 64, 64, g), 64)
    assert qmt.gemv_plan(n, 64, torch.device("cpu"))[1] == 1
    x = torch.randn(1, 64, generator=g)
    out = qmt.int4_matmul(x, qw.packed, qw.scales, qw.mins, 64, path="gemv")
    assert rel_err(out, x @ dequantize_int4(qw).T) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("shape", [(960, 576), (576, 576), (3072, 576), (576, 1536)], ids=str)
def test_int4_gemv_fills_the_gpu_for_the_default_models_projections(shape: tuple[int, int]) -> None:
    """qkv, o, gate/up and down of SmolLM2-135M at one row: >= 2 programs per SM of an H100."""
    n, k = shape
    block_k, split = qmt.gemv_plan(n, k, torch.device("cpu"))
    assert k % block_k == 0 and block_k >= qmt.GEMV_MIN_BLOCK_K
    assert -(-n // qmt.GEMV_BLOCK_N) * split >= 2 * 132


def test_int4_gemv_and_gemm_round_alike() -> None:
    """Both round the dequantised weight to the activations' dtype (tensor cores see it so), so a
    row's output barely depends on the batch size that picked the kernel: fp16 rows agree but for
    the summation order and the output's rounding."""
    g = torch.Generator().manual_seed(13)
    qw = quantize_int4(weight(72, 256, 32, g), 32)
    x = torch.randn(12, 256, generator=g).half()
    gemm = qmt.int4_matmul(x, qw.packed, qw.scales, qw.mins, 32, path="gemm")
    for rows in (1, 5):
        gemv = qmt.int4_matmul(x[:rows], qw.packed, qw.scales, qw.mins, 32, path="gemv")
        assert rel_err(gemv, gemm[:rows].float()) < 2e-3
    q8 = quantize_int8(weight(72, 256, 256, g))
    gemm = qmt.int8_matmul(x, q8.qweight, q8.scales, q8.group_size, path="gemm")
    gemv = qmt.int8_matmul(x[:3], q8.qweight, q8.scales, q8.group_size, path="gemv")
    assert rel_err(gemv, gemm[:3].float()) < 2e-3


# Every kernel compiled for every GPU generation (see gpu_compile.py) with the alignment the runtime
# sees; in gpu_compile's dtypes (Turing has no bf16 tensor cores and runs fp16, llmd.daemon.device;
# fp32 once, the IEEE tl.dot branches). Both GEMV variants (one row;
# 2..16 rows on tensor cores) with split-K, and the GEMMs at their largest tile, with the decode
# step's fusions (the norm prologue of qkv and gate/up; SiLU x up before down with the residual add
# after it; bias), for the default model's group size (32) and 128.
COMPILE_FOR_GPU = """
import llmd.kernels.quant_matmul_triton as q

ALIGNED_PTRS = ("x_ptr", "packed_ptr", "q_ptr", "scales_ptr", "mins_ptr", "out_ptr", "part_ptr", "count_ptr",
                "norm_w_ptr", "bias_ptr", "res_ptr")
def aligned(sig):
    return [name for name in sig if name in ALIGNED_PTRS or name.startswith("stride_") or name in ("N", "K")]

gemv = {"scales_ptr": "*fp16", "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
        "eps": "fp32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_om": "i32",
        "stride_rm": "i32", "K_ITERS": "i32", "SPLIT": "i32"}
gemv4, gemv8 = dict(gemv, packed_ptr="*u8", mins_ptr="*fp16"), dict(gemv, q_ptr="*i8")
common = {"scales_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32", "eps": "fp32", "stride_xm": "i32",
          "stride_om": "i32", "stride_rm": "i32"}
int4, int8 = dict(common, packed_ptr="*u8", mins_ptr="*fp16"), dict(common, q_ptr="*i8")
gemm = dict(BLOCK_M=q.GEMM_MAX_BLOCK_M, BLOCK_N=q.GEMM_BLOCK_N, BLOCK_K=q.GEMM_MAX_BLOCK_K)
NORM = dict(PROLOGUE=q.PRO_RMS_NORM, HAS_BIAS=False, HAS_RESIDUAL=False, NORM_BLOCK=q.GEMV_NORM_BLOCK)
SILU_RES = dict(PROLOGUE=q.PRO_SILU_MUL, HAS_BIAS=False, HAS_RESIDUAL=True, NORM_BLOCK=q.GEMV_NORM_BLOCK)
BIAS_RES = dict(PROLOGUE=q.PRO_NONE, HAS_BIAS=True, HAS_RESIDUAL=True, NORM_BLOCK=q.GEMV_NORM_BLOCK)
ROWS = q.GEMV_DOT_BLOCK_M
kernels = [("int4 gemv 1 row g32 norm", q._int4_gemv_kernel, gemv4,
            dict(NORM, GROUP_SIZE=32, BLOCK_M=1, BLOCK_N=q.GEMV_BLOCK_N, NG=2, GH=16)),
           ("int4 gemv 1 row g128 silu+residual", q._int4_gemv_kernel, gemv4,
            dict(SILU_RES, GROUP_SIZE=128, BLOCK_M=1, BLOCK_N=q.GEMV_BLOCK_N, NG=1, GH=64)),
           ("int4 gemv 2-16 rows g32 norm", q._int4_gemv_kernel, gemv4,
            dict(NORM, GROUP_SIZE=32, BLOCK_M=ROWS, BLOCK_N=q.GEMV_BLOCK_N, NG=2, GH=16)),
           ("int4 gemv 2-16 rows g32 silu+residual", q._int4_gemv_kernel, gemv4,
            dict(SILU_RES, GROUP_SIZE=32, BLOCK_M=ROWS, BLOCK_N=q.GEMV_BLOCK_N, NG=2, GH=16)),
           ("int8 gemv 1 row norm", q._int8_gemv_kernel, gemv8,
            dict(NORM, GROUP_SIZE=4096, BLOCK_M=1, BLOCK_N=q.GEMV_BLOCK_N, BLOCK_K=q.GEMV_MAX_BLOCK_K)),
           ("int8 gemv 2-16 rows bias+residual", q._int8_gemv_kernel, gemv8,
            dict(BIAS_RES, GROUP_SIZE=4096, BLOCK_M=ROWS, BLOCK_N=q.GEMV_BLOCK_N,
                 BLOCK_K=q.GEMV_INT8_DOT_MAX_BLOCK_K)),
           ("int4 gemm norm", q._int4_gemm_kernel, int4, dict(gemm, **NORM, GROUP_SIZE=64)),
           ("int8 gemm silu+residual", q._int8_gemm_kernel, int8, dict(gemm, **SILU_RES, GROUP_SIZE=64))]
reports = []
for arch in ARCHS:
    for x in dtypes(arch):
        for label, fn, signature, constexprs in kernels:
            sig = dict(signature, x_ptr=f"*{x}", out_ptr=f"*{x}")
            sig.update(norm_w_ptr=f"*{x}", bias_ptr=f"*{x}", res_ptr=f"*{x}")
            warps = q.GEMM_NUM_WARPS if "gemm" in label else 4
            r = ptxas_report(compile_for(fn, sig, constexprs, arch, aligned(sig), num_warps=warps))
            print(label, x, r)
            reports.append((label, x, r))
for label, x, r in reports:
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (label, x, r)
    assert r["shared"] <= 99 * 1024, (label, x, r)
    # the weights' bytes in vector loads (16 bytes per row of an INT4 tile), never one by one
    assert r["vector_loads"] and not r["byte_loads"], (label, x, r)
"""


def test_kernels_compile_for_every_gpu_generation(tmp_path: Path) -> None:
    out = compile_for_gpu(COMPILE_FOR_GPU, tmp_path)
    assert out.count("'registers'") == 8 * (1 + 3 + 2 * 1), out[-2000:]  # sm_75, sm_80, sm_86/90
