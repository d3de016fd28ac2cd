"""The CPU paths of quantised layers with bf16 activations (ours, torch's packed kernels) against the
reference path, on ragged shapes."""

from __future__ import annotations

import pytest
import torch

from llmd.kernels import native
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
    # our kernels serve bf16 too wherever the library builds; torch's packed one only without it
    want = "native" if native.library() is not None else "packed" if has_fast_bf16() else "reference"
    assert layer.cpu_path == want
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


@pytest.mark.parametrize("m", [1, 17, 300])
def test_packed_path_matches_reference(m: int) -> None:
    """torch's packed int4 layout and kernel (bf16 on a CPU with native bf16 when our library cannot
    be had; forced here on any CPU): within bf16 rounding of the reference, and only its layout held."""
    n, k = 100, 384  # N not a multiple of torch's 16-row packing: padded, then sliced
    g = torch.Generator().manual_seed(m)
    qw = quantize_int4(torch.randn(n, k, generator=g), 32)
    layer = Int4Linear.from_weight(qw)
    layer.use("packed", torch.bfloat16)
    assert layer.cpu_packed is not None and layer.packed.numel() == 0 and layer.native is None
    x = torch.randn(m, k, generator=g)
    out = layer(x.bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert rel_err(out, x @ dequantize_int4(qw).t()) < 2e-2
