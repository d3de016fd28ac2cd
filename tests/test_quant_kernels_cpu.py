"""The packed CPU kernels (bf16 activations) against the reference path, on ragged shapes."""

from __future__ import annotations

import pytest
import torch

from llmd.kernels.cpu_profile import has_fast_bf16
from llmd.quant.int4 import Int4Linear, dequantize_int4, quantize_int4
from llmd.quant.int8 import Int8Linear, dequantize_int8, quantize_int8


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_linear_bf16_matches_reference(m: int, group_size: int) -> None:
    n, k = 100, 384  # N not a multiple of any tile size
    g = torch.Generator().manual_seed(m * group_size)
    qw = quantize_int4(torch.randn(n, k, generator=g), group_size)
    bias = torch.randn(n, generator=g)
    layer = Int4Linear.from_weight(qw, bias)
    x = torch.randn(m, k, generator=g)
    ref = x @ dequantize_int4(qw).t() + bias
    assert rel_err(layer(x), ref) < 1e-5  # fp32 activations: the reference path
    layer.prepare(torch.bfloat16)
    assert (layer.cpu_packed is not None) == has_fast_bf16()  # torch's kernel is used where it pays...
    if layer.cpu_packed is not None:
        assert layer.packed.numel() == 0  # ...and only its layout is held
    out = layer(x.bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert rel_err(out, ref) < 2e-2  # bf16 rounding of x, of the scales and of the output


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("group_size", [None, 32])
def test_int8_linear_bf16_matches_reference(m: int, group_size: int | None) -> None:
    n, k = 100, 384
    g = torch.Generator().manual_seed(m)
    qw = quantize_int8(torch.randn(n, k, generator=g), group_size)
    layer = Int8Linear.from_weight(qw)
    x = torch.randn(2, m, k, generator=g)  # leading batch dims are kept
    ref = x @ dequantize_int8(qw).t()
    assert rel_err(layer(x), ref) < 1e-5
    out = layer(x.bfloat16())
    assert out.shape == (2, m, n) and rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (100, 384)])  # 100: not a 64-row layout, no expansion
def test_prompt_chunks_expand_the_packed_weight_to_dense_bf16(n: int, k: int) -> None:
    """The packed path (served on CPUs with native bf16; forced here on any): 256+ rows expand
    torch's packed int4 weight to dense bf16 (kernels/cpu/int4pack_gemm.c) for a dense matmul
    where the layout is the one the kernels read (torch's AVX-512 builds), else torch's kernel
    serves every call. The expansion is checked bit for bit against torch's own kernel (the
    identity times the weight), and the layer's output stays within bf16 rounding of the
    small-batch path."""
    from llmd.kernels import native, quant_cpu

    if native.library() is None:
        pytest.skip("no native library")
    g = torch.Generator().manual_seed(n)
    qw = quantize_int4(torch.randn(n, k, generator=g), 32)
    layer = Int4Linear.from_weight(qw)
    layer.use("packed", torch.bfloat16)
    assert layer.cpu_dense_ok == (n % 64 == 0 and quant_cpu.int4pack_layout_known(n, k, 32))
    if layer.cpu_dense_ok:
        eye = torch.eye(k, dtype=torch.bfloat16)
        by_torch = quant_cpu.int4_mm_cpu(eye, layer.cpu_packed, 32, layer.cpu_scales_zeros)
        dense_t = quant_cpu.int4pack_to_bf16_t(layer.cpu_packed, layer.cpu_scales_zeros, layer.cpu_packed.shape[0],
                                               k, 32)
        assert torch.equal(dense_t, by_torch)
    x = torch.randn(quant_cpu.DENSE_ROWS + 6, k, generator=g).bfloat16()
    big = layer(x)  # one call over all rows: the dense path where it applies
    small = torch.cat([layer(x[i:i + 8]) for i in range(0, len(x), 8)])  # the small-batch kernel
    assert big.shape == small.shape == (len(x), n)
    assert rel_err(big, small.float()) < 1e-2


@pytest.mark.skipif(not has_fast_bf16(), reason="torch's packed int4 path runs on CPUs with native bf16")
def test_decode_batches_take_the_native_kernels_on_the_packed_layout() -> None:
    """Under 256 rows: kernels/cpu/int4pack_gemm.c on torch's layout."""
    from llmd.kernels import quant_cpu

    if not quant_cpu.int4pack_gemm_usable():
        pytest.skip("no vectorised native int4pack kernel on this CPU")
    n, k = 960, 576
    g = torch.Generator().manual_seed(7)
    layer = Int4Linear.from_weight(quantize_int4(torch.randn(n, k, generator=g), 32))
    layer.prepare(torch.bfloat16)
    assert layer.cpu_gemm_ok
    x = torch.randn(quant_cpu.DENSE_ROWS - 1, k, generator=g).bfloat16()
    sz, packed = layer.cpu_scales_zeros, layer.cpu_packed
    for rows in (1, 7, 16, quant_cpu.DENSE_ROWS - 1):
        want = quant_cpu.int4pack_mm_bf16(x[:rows], packed, sz, packed.shape[0], 32)[:, :n]
        assert torch.equal(layer(x[:rows]), want)
