"""Quantisation formats: packing is exact, round trips stay within each format's bound, GGUF
blocks import bit-exactly, and the quantised Linears equal a Linear over the dequantised weight."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from llmd.quant.common import pack_int4, unpack_int4
from llmd.kernels import quant_cpu
from llmd.quant import gguf_import
from llmd.quant.gguf_import import Q4Blocks, import_q4_0, import_q4_1, import_q8_0
from llmd.quant.int4 import Int4Linear, dequantize_int4, quantize_int4
from llmd.quant.int8 import Int8Linear, dequantize_int8, quantize_int8


def weight(n: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int4_packing_is_exact() -> None:
    q = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)
    with pytest.raises(ValueError):
        pack_int4(torch.zeros(3, 5, dtype=torch.uint8))


@pytest.mark.parametrize("group_size", [None, 32, 128])
def test_int8_round_trip_within_half_a_step(group_size: int | None) -> None:
    w = weight()
    qw = quantize_int8(w, group_size)
    err = (dequantize_int8(qw) - w).abs()
    g = group_size or w.shape[1]
    bound = qw.scales.repeat_interleave(g, dim=1) / 2 + 1e-7
    assert (err <= bound).all()
    assert qw.qweight.dtype == torch.int8 and qw.nbytes < w.numel() * 4 * 0.3


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_round_trip_within_half_a_step(group_size: int, symmetric: bool) -> None:
    w = weight()
    qw = quantize_int4(w, group_size, symmetric)
    err = (dequantize_int4(qw) - w).abs()
    bound = qw.scales.repeat_interleave(group_size, dim=1) / 2 + 1e-6
    assert (err <= bound).all()
    assert qw.nbytes <= w.numel() * 4 * (0.2 if group_size >= 64 else 0.25)
    if symmetric:
        assert torch.equal(qw.mins, -8 * qw.scales)


def test_int4_rejects_bad_group_sizes() -> None:
    with pytest.raises(ValueError):
        quantize_int4(weight(), 48)
    with pytest.raises(ValueError):
        quantize_int4(weight(k=96), 64)


@pytest.mark.parametrize("qtype,importer,dequant", [
    (Q.Q8_0, import_q8_0, dequantize_int8), (Q.Q4_0, import_q4_0, dequantize_int4),
    (Q.Q4_1, import_q4_1, dequantize_int4),
])
def test_gguf_blocks_import_bit_exactly(qtype, importer, dequant) -> None:
    w = weight(n=24, k=320).numpy()
    raw = gguf.quants.quantize(w, qtype)
    ours = dequant(importer(raw)).numpy()
    ref = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
    assert np.array_equal(ours, ref)


def test_q8_0_blocks_are_compacted_in_their_own_memory_chunk_by_chunk(monkeypatch) -> None:
    """Q8_0 values moved down over their scales a few rows at a time (5 here: 24 rows in five
    chunks, the last short) dequantise to gguf's own values exactly, and stay in the blocks' memory."""
    monkeypatch.setattr(gguf_import, "COMPACT_ROWS", 5)
    w = weight(n=24, k=320).numpy()
    raw = gguf.quants.quantize(w, Q.Q8_0)
    held = np.array(raw)  # writable: taken as it is
    q8 = import_q8_0(held, consume=True)
    assert q8.qweight.data_ptr() == held.ctypes.data
    assert np.array_equal(dequantize_int8(q8).numpy(), gguf.quants.dequantize(raw, Q.Q8_0).reshape(w.shape))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_gguf_q4_blocks_become_the_native_layout_by_bytes_alone(qtype, monkeypatch) -> None:
    """GGUF Q4 blocks straight into the native kernels' layout (a byte permutation: the native
    library's, and torch's where there is none) equal the two repackings they replace (into llmd's
    layout, then the native one), byte for byte; and a layer filled with them in shards (as a fused
    qkv is) holds the same weight on every path."""
    w = weight(n=24, k=320).numpy()
    raw = gguf.quants.quantize(w, qtype)
    blocks = Q4Blocks.of(raw, qtype.name)
    via_llmd = quant_cpu.PackedWeight.from_int4(blocks.to_int4())
    assert blocks.raw.is_contiguous() and quant_cpu.library() is not None  # so the first pass is the C's
    for native in ("1", "0"):
        monkeypatch.setenv("LLMD_NATIVE", native)
        for ours, theirs in zip(blocks.native_parts(), (via_llmd.w, via_llmd.scales, via_llmd.mins), strict=True):
            assert ours is theirs is None or torch.equal(ours, theirs)
    monkeypatch.delenv("LLMD_NATIVE")
    assert (via_llmd.mins is None) == (qtype.name == "Q4_0")  # Q4_0's mins are -8 * scale: the kernels' own
    exact = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(w.shape))
    for path in ("native", "reference"):
        layer = Int4Linear(320, 24, 32)
        layer.load_rows(16, Q4Blocks.of(raw[16:], qtype.name))  # shards in any order
        layer.load_rows(0, Q4Blocks.of(raw[:16], qtype.name))
        if path == "native" and quant_cpu.cpu_path(torch.float32, 320) != "native":
            continue
        layer.use(path, torch.float32)
        assert torch.equal(dequantize_int4(layer.weight()), exact), path
    odd = Int4Linear(320, 24, 32)  # rows not in whole groups of 8: converted at once, still exact
    odd.load_rows(0, Q4Blocks.of(raw[:5], qtype.name))
    odd.load_rows(5, Q4Blocks.of(raw[5:], qtype.name))
    assert torch.equal(dequantize_int4(odd.weight()), exact)


def test_a_layer_of_q4_0_and_q4_1_shards_keeps_mins_for_all() -> None:
    """A fused layer whose shards come as Q4_0 (no mins held: the kernels compute them) and Q4_1
    (stored mins) holds -8 * scale for the Q4_0 rows beside the Q4_1 ones, and the exact weight."""
    w = weight(n=24, k=320).numpy()
    q4_0, q4_1 = gguf.quants.quantize(w, Q.Q4_0), gguf.quants.quantize(w, Q.Q4_1)
    exact = torch.cat([torch.from_numpy(gguf.quants.dequantize(q4_0, Q.Q4_0).reshape(w.shape))[:16],
                       torch.from_numpy(gguf.quants.dequantize(q4_1, Q.Q4_1).reshape(w.shape))[16:]])
    layer = Int4Linear(320, 24, 32)
    layer.load_rows(0, Q4Blocks.of(q4_0[:16], "Q4_0"))
    layer.load_rows(16, Q4Blocks.of(q4_1[16:], "Q4_1"))
    if quant_cpu.cpu_path(torch.float32, 320) != "native":
        pytest.skip("the native kernels are not this machine's path")
    layer.use("native", torch.float32)
    assert layer.native.mins is not None
    assert torch.equal(dequantize_int4(layer.weight()), exact)


def test_default_model_blocks_import_bit_exactly(default_model_path) -> None:
    reader = gguf.GGUFReader(str(default_model_path))
    seen = set()
    for t in reader.tensors:
        if t.tensor_type.name in seen or t.tensor_type.name not in ("Q4_1", "Q8_0"):
            continue
        seen.add(t.tensor_type.name)
        importer, dequant = {"Q4_1": (import_q4_1, dequantize_int4), "Q8_0": (import_q8_0, dequantize_int8)}[
            t.tensor_type.name]
        ours = dequant(importer(np.asarray(t.data))).numpy()
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.array_equal(ours, ref.reshape(ours.shape)), t.name
    assert seen == {"Q4_1", "Q8_0"}


def test_quantised_linears_equal_linear_over_dequantised_weight() -> None:
    w, b = weight(), torch.randn(48)
    x = torch.randn(5, 256)
    q8 = quantize_int8(w, 32)
    q4 = quantize_int4(w, 64)
    assert torch.allclose(Int8Linear.from_weight(q8, b)(x), F.linear(x, dequantize_int8(q8), b), atol=1e-6)
    assert torch.allclose(Int4Linear.from_weight(q4)(x), F.linear(x, dequantize_int4(q4)), atol=1e-6)
