"""The native CPU kernels (kernels/cpu/*.c) against their torch references, in both builds: the
one for this CPU (AVX2+FMA, VNNI where the CPU has it; -march=native) and the portable C; and the fallback when the library
cannot be had."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from llmd.kernels import cpu_profile, native, quant_cpu
from llmd.kernels.kv_format import to_cache
from llmd.kernels.quant_cpu import PackedWeight
from llmd.quant.common import pack_int4
from llmd.quant.int4 import Int4Linear, Int4Weight, dequantize_int4, quantize_int4
from llmd.quant.int8 import Int8Linear, Int8Weight, quantize_int8

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(scope="module", params=["native-arch", "portable"])
def lib(request) -> ctypes.CDLL:
    if request.param == "native-arch":
        built = native.library()
        assert built is not None, "a machine with a C compiler must build the library"
        assert built.llmd_has_avx2() == cpu_profile.has("avx2")
        # VNNI (the int8 dots in one instruction) where the profile allows it: this fixture then
        # checks that build against the portable C, bit for bit.
        assert built.llmd_has_vnni() == (cpu_profile.has("avx512_vnni") and cpu_profile.has("avx512vl")
                                         or cpu_profile.has("avx_vnni"))
        # the 512-bit tiles where the profile has AVX-512 with VNNI: checked against the portable C too
        assert built.llmd_has_avx512() == all(cpu_profile.has(f) for f in ("avx512f", "avx512bw", "avx512_vnni"))
        assert built.llmd_rows_per_pass() == 8  # the tiles' rows, in every build
        return built
    portable = native.load(native.build(portable=True))  # (cached with the other builds: conftest.py)
    assert not portable.llmd_has_avx2() and portable.llmd_rows_per_pass() == 8
    return portable


# (m, n, k): m every count of an 8-row tile's rows (1-8) and past it, n not a multiple of the 8-row
# groups, k from one block up; the last, rows in several chunks (the last one short) against weights in
# several blocks (quant_gemm.c: CHUNK_BYTES, WEIGHT_BLOCK_BYTES).
SHAPES = [(1, 1, 32), (1, 17, 576), (2, 9, 64), (3, 33, 256), (4, 24, 96), (5, 64, 288), (6, 17, 128), (7, 9, 64),
          (9, 24, 128), (16, 7, 1536), (33, 40, 96), (50, 1040, 1536)]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_activation_quantisation_is_bit_exact(lib, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(k + m)
    x = torch.randn(m, k, generator=g) * 3
    x[0, :32] = 0.0  # an all-zero block: scale 0, values 0
    x[-1, -32:] = torch.tensor([0.5, -0.5, 1.5, -2.5] * 8) * (127 / 2.5)  # ties round to even
    for got, want in zip(quant_cpu.quantize_activations(x, lib), quant_cpu.quantize_activations_ref(x)):
        assert torch.equal(got, want)


def exact_inputs(m: int, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integers whose every product and sum is exact in fp32: activations with one power-of-two
    scale per block (an entry of +-127 in each block), int4 values and power-of-two weight scales."""
    q_x = torch.randint(-127, 128, (m, k), generator=g)
    q_x.view(m, k // 32, 32)[..., 0] = 127
    x = q_x.float() * 2.0 ** -5
    q_w = torch.randint(0, 16, (n, k), generator=g)
    return x, q_x, q_w


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int4_integer_parts_are_exact(lib, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * k)
    x, q_x, q_w = exact_inputs(m, n, k, g)
    scales = torch.full((n, k // 32), 2.0 ** -3, dtype=torch.float16)
    weight = PackedWeight.from_int4(Int4Weight(pack_int4(q_w), scales, -8 * scales, 32))  # w = scale * (q - 8)
    exact = (q_x @ (q_w - 8).t()).double() * 2.0 ** -5 * 2.0 ** -3
    assert torch.equal(weight(x, lib).double(), exact)
    assert torch.equal(quant_cpu.qgemm_ref(x, weight).double(), exact)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_integer_parts_are_exact(lib, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * k + 1)
    x, q_x, _ = exact_inputs(m, n, k, g)
    q_w = torch.randint(-128, 128, (n, k), generator=g)  # -128 occurs in imported GGUF Q8_0 blocks
    q_w[0, :32] = -128
    scales = torch.full((n, 1), 2.0 ** -4, dtype=torch.float16)
    weight = PackedWeight.from_int8(Int8Weight(q_w.to(torch.int8), scales, k))
    assert torch.equal(weight(x, lib).double(), (q_x @ q_w.t()).double() * 2.0 ** -9)


@pytest.mark.parametrize("group_size", [16, 48, 96])
def test_a_group_the_tiles_cannot_walk_is_refused(group_size: int) -> None:
    # 16: under a block of 32 (the tiles would read the wrong scales); 48: not whole blocks (past
    # them); 96 does not divide 64 inputs. Each raises before any repacking, so a weight given to
    # be repacked in place (consume=True) is left as it was.
    k = 64 if group_size == 96 else 96
    q_w = torch.zeros(8, k, dtype=torch.int8)
    q_w[1, 0] = 5  # row 1's first input: a repack moves it (to byte 4)
    weight = Int8Weight(q_w, torch.ones(8, max(k // group_size, 1), dtype=torch.float16), group_size)
    with pytest.raises(ValueError, match="groups of a multiple of 32"):
        PackedWeight.from_int8(weight, consume=True)
    assert weight.qweight[1, 0] == 5 and weight.qweight.abs().sum() == 5  # not repacked


def close_in_fp32(got: torch.Tensor, want: torch.Tensor, terms: torch.Tensor) -> bool:
    """Equal up to fp32 rounding of a sum whose terms' magnitudes add up to ``terms``."""
    return bool(((got - want).abs() <= 1e-5 * terms + 1e-30).all())


@pytest.mark.parametrize("m,n,k,group_size", [(*s, g) for s in SHAPES for g in (32, 64, 128) if s[2] % g == 0])
def test_int4_matches_reference_within_fp32_rounding(lib, m: int, n: int, k: int, group_size: int) -> None:
    g = torch.Generator().manual_seed(m + n + group_size)
    x = torch.randn(m, k, generator=g)
    qw = quantize_int4(torch.randn(n, k, generator=g), group_size)
    weight = PackedWeight.from_int4(qw)
    largest_weight = qw.scales.float().abs().max() * 15 + qw.mins.float().abs().max()
    assert close_in_fp32(weight(x, lib), quant_cpu.qgemm_ref(x, weight), x.abs().sum(-1, keepdim=True) * largest_weight)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("group_size", [32, None])
def test_int8_matches_reference_within_fp32_rounding(lib, m: int, n: int, k: int, group_size: int | None) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g)
    qw = quantize_int8(torch.randn(n, k, generator=g), group_size)
    weight = PackedWeight.from_int8(qw)
    terms = x.abs() @ (qw.qweight.float().abs() * qw.scales.float().max()).t()
    assert close_in_fp32(weight(x, lib), quant_cpu.qgemm_ref(x, weight), terms)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_symmetric_int4_is_held_without_mins_and_gives_the_same_bits(lib, m: int, n: int, k: int) -> None:
    """A symmetric INT4 weight (GGUF Q4_0: every min -8 * its scale) is held without mins, the
    kernels computing each: the bits its stored mins give, in every build and batch, in less memory.
    An asymmetric one keeps its mins."""
    g = torch.Generator().manual_seed(3 * m + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    for group_size in [s for s in (32, 64, 128) if k % s == 0]:
        qw = quantize_int4(w, group_size, symmetric=True)
        held = PackedWeight.from_int4(qw)
        assert held.mins is None
        stored = dataclasses.replace(held, mins=quant_cpu.repack_q4x8(qw.packed, qw.scales, qw.mins)[2])
        assert held.nbytes < stored.nbytes
        got = held(x, lib)
        assert torch.equal(got, stored(x, lib))
        assert torch.equal(got[-1:], held(x[-1:], lib))
        assert torch.equal(dequantize_int4(Int4Weight(*quant_cpu.unpack_q4x8(held.w, held.scales, None, n),
                                                      group_size)), dequantize_int4(qw))
    assert PackedWeight.from_int4(quantize_int4(w, 32)).mins is not None


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_matmul_bits_do_not_depend_on_build_batch_or_threads(lib, kind: str, m: int, n: int, k: int) -> None:
    """One order of operations everywhere: the portable C gives the vector build's bits, a row alone
    gives what it gives in a batch (any place in the 8-row tiles), on one thread or two."""
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    weight = PackedWeight.from_int4(quantize_int4(w, 32)) if kind == "int4" else PackedWeight.from_int8(quantize_int8(w, 32))
    got = weight(x, lib)
    assert torch.equal(got, weight(x, native.library()))
    for i in {0, m // 2, m - 1}:
        assert torch.equal(weight(x[i:i + 1], lib), got[i:i + 1])
    xq, xd, xm = quant_cpu.quantize_activations(x, lib)
    one_thread = torch.empty(m, n)
    mins = 0 if weight.mins is None else weight.mins.data_ptr()
    lib.llmd_qgemm_q8(weight.kind, xq.data_ptr(), xd.data_ptr(), xm.data_ptr(), m, k, weight.w.data_ptr(),
                      weight.scales.data_ptr(), mins, n, weight.group_size, one_thread.data_ptr(), 1)
    assert torch.equal(one_thread, got)


@pytest.mark.parametrize("n", [1, 8, 13, 64])
def test_repacking_is_lossless(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    q4 = quantize_int4(torch.randn(n, 256, generator=g), 64)
    w, s, mn = quant_cpu.repack_q4x8(q4.packed, q4.scales, q4.mins)
    assert w.shape == (-(-n // 8), 8, 128) and s.shape == mn.shape == (-(-n // 8), 4, 8)
    for got, want in zip(quant_cpu.unpack_q4x8(w, s, mn, n), (q4.packed, q4.scales, q4.mins)):
        assert torch.equal(got, want)
    q8 = quantize_int8(torch.randn(n, 256, generator=g), 32)
    w, s = quant_cpu.repack_q8x8(q8.qweight, q8.scales)
    assert w.shape == (-(-n // 8), 8, 256) and s.shape == (-(-n // 8), 8, 8)
    for got, want in zip(quant_cpu.unpack_q8x8(w, s, n), (q8.qweight, q8.scales)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("n", [8, 40, 13])
def test_repacking_in_place_equals_repacking_by_copy(n: int, native: str, monkeypatch) -> None:
    """The INT8 layout made in the weight's own memory (by the native library, a group of 8 rows at
    a time; or by torch, a chunk of 16 rows at a time here, so the 40 rows take three chunks, the last
    one short) is the copying repack's, byte for byte; rows in no whole groups of 8 are repacked by copy."""
    monkeypatch.setattr(quant_cpu, "IN_PLACE_ROWS", 16)
    monkeypatch.setenv("LLMD_NATIVE", native)
    q8 = quantize_int8(torch.randn(n, 256, generator=torch.Generator().manual_seed(n)), 32)
    want = quant_cpu.repack_q8x8(q8.qweight, q8.scales)
    weight = q8.qweight.clone()
    got = quant_cpu.repack_q8x8_in_place(weight, q8.scales)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert (got[0].data_ptr() == weight.data_ptr()) == (n % 8 == 0)  # its own memory, when it can


def test_the_q8_reference_is_close_to_the_dequantised_matmul() -> None:
    """Quantising activations costs little: what the native path computes stays within 1% of the
    dequantise-then-multiply reference (the unquantised activations)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 576, generator=g), torch.randn(300, 576, generator=g)
    qw = quantize_int4(w, 32)
    ref = x @ dequantize_int4(qw).t()
    got = quant_cpu.qgemm_ref(x, PackedWeight.from_int4(qw))
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("cls", [Int4Linear, Int8Linear])
def test_layers_take_the_native_kernel_for_fp32_and_match_it(cls) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 320, generator=g)
    qw: Int4Weight | Int8Weight = quantize_int4(w, 64) if cls is Int4Linear else quantize_int8(w, 32)
    bias = torch.randn(70, generator=g)
    layer = cls.from_weight(qw, bias)
    layer.prepare(torch.float32)
    assert layer.cpu_path == "native" and layer.native is not None
    x = torch.randn(2, 3, 320, generator=g)
    want = quant_cpu.qgemm_ref(x.reshape(6, 320), layer.native)
    got = layer(x)
    assert got.shape == (2, 3, 70)
    assert torch.allclose(got.reshape(6, 70), want + bias, rtol=1e-5, atol=1e-4)
    held = layer.weight()  # unpacked again from the kernels' layout: the same weight
    for name in ("scales",) + (("packed", "mins") if cls is Int4Linear else ("qweight",)):
        assert torch.equal(getattr(held, name), getattr(qw, name))


def test_without_the_library_layers_fall_back_to_torch(monkeypatch) -> None:
    """No compiler (or LLMD_NATIVE=0): library() is None and the layers take the reference path,
    which computes the dequantised matmul."""
    native.library.cache_clear()
    try:
        monkeypatch.setenv("LLMD_NATIVE", "0")
        assert native.library() is None
        native.library.cache_clear()
        monkeypatch.delenv("LLMD_NATIVE")
        monkeypatch.setenv("CC", "no-such-compiler")
        with pytest.raises(native.NativeBuildError, match="no C compiler"):
            native.build(out_dir=None)
        assert native.library() is None
        g = torch.Generator().manual_seed(4)
        qw = quantize_int4(torch.randn(50, 256, generator=g), 32)
        layer = Int4Linear.from_weight(qw)
        layer.prepare(torch.float32)
        assert layer.cpu_path == "reference"
        x = torch.randn(3, 256, generator=g)
        assert torch.allclose(layer(x), x @ dequantize_int4(qw).t(), rtol=1e-5, atol=1e-5)
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native.library() is not None


# -- paged decode attention ------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 36)])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_attention_matches_reference(lib, cache_dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                                            window: int | None) -> None:
    """Ragged context lengths around block edges (1, 15, 16, 17, 100), GQA groups 1/3/4, a head
    size that is no multiple of 8 (the vector loop's tail), shuffled block tables, sliding window."""
    from llmd.kernels import attention_cpu, attention_ref

    g = torch.Generator().manual_seed(num_heads * head_dim + (window or 0))
    block_size, num_blocks = 16, 40
    seq_lens = [1, 15, 16, 17, 100]
    k_cache = to_cache(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g), cache_dtype)
    v_cache = to_cache(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g), cache_dtype)
    tables = torch.randperm(num_blocks, generator=g)[:len(seq_lens) * 7].reshape(len(seq_lens), 7)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    scale = head_dim ** -0.5
    got = attention_cpu.decode_attention(query, k_cache, v_cache, seq_lens, tables, scale, window, lib)
    want = attention_ref.decode_attention(query, k_cache, v_cache, seq_lens, tables, scale, window)
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_rejects_what_it_cannot_read() -> None:
    from llmd.kernels import attention_cpu

    cache = torch.zeros(2, 16, 1, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="fp32, bf16 or int8"):
        attention_cpu.decode_attention(torch.zeros(1, 1, 8), cache, cache, [1], torch.zeros(1, 1), 1.0)


@pytest.mark.parametrize("model", ["qwen2", "mistral", "smollm2"])  # GQA 2 + qkv bias; sliding window 16; GQA 3
def test_cpu_backend_generates_what_the_torch_backend_does(tmp_path, model: str) -> None:
    """The engine with the cpu attention backend: same greedy tokens as the reference backend over
    chunked prompts, prefix hits and mixed prefill/decode steps."""
    from test_engine_triton import make_requests
    from tiny_models import make_engine, make_hf_model, run_engine, save_hf_model

    from llmd.daemon.attention import CpuAttentionBackend, TorchAttentionBackend

    model_dir = save_hf_model(make_hf_model(model), tmp_path / model, with_tokenizer=True)
    requests = make_requests(seed=len(model))
    config = dict(num_blocks=96, block_size=16, max_batched_tokens=24)
    expected = run_engine(make_engine(model_dir, attention=TorchAttentionBackend(), **config), requests)
    assert run_engine(make_engine(model_dir, attention=CpuAttentionBackend(), **config), requests) == expected


def test_cpu_backend_takes_the_reference_for_other_cache_dtypes() -> None:
    """An fp16 cache (--dtype float16): no error, the reference's result."""
    from llmd.daemon.attention import AttentionMetadata, CpuAttentionBackend, TorchAttentionBackend

    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, n, 16, generator=g).half() for n in (4, 2, 2))
    outs = []
    for backend in (CpuAttentionBackend(), TorchAttentionBackend()):
        cache = (torch.zeros(4, 16, 2, 16, dtype=torch.float16), torch.zeros(4, 16, 2, 16, dtype=torch.float16))
        meta = AttentionMetadata(slot_mapping=torch.tensor([0, 16]), query_lens=[1, 1], seq_lens=[1, 1],
                                 block_tables=torch.tensor([[0], [1]]))
        outs.append(backend.forward(q, k, v, cache, meta, 0.25, None))
    assert torch.equal(outs[0], outs[1])


# -- RoPE ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 80])
def test_rope_matches_reference_on_strided_views(lib, dtype, tokens: int) -> None:
    """q and k as views into one fused qkv row, as the attention layer has them; rotated in place.
    The same products and roundings as the reference: equal (fp32 bit for bit)."""
    from llmd.daemon.model_config import RopeConfig
    from llmd.daemon.models.layers import RotaryEmbedding, rope_torch
    from llmd.kernels import rope_cpu

    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, head_dim = 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    cos, sin = RotaryEmbedding(RopeConfig(), head_dim).cos_sin(torch.arange(100, 100 + tokens), dtype)
    want_q, want_k = rope_torch(q, cos, sin), rope_torch(k, cos, sin)
    assert rope_cpu.usable(q, cos) and rope_cpu.usable(k, cos)
    rope_cpu.rope_(q, cos, sin, lib)
    rope_cpu.rope_(k, cos, sin, lib)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("seq_lens,num_kv_heads", [([300], 3), ([700, 1], 1), ([600], 1)])
@pytest.mark.parametrize("window", [None, 250])
def test_decode_attention_split_over_keys_matches_reference(lib, cache_dtype, seq_lens: list[int],
                                                            num_kv_heads: int, window: int | None) -> None:
    """Long contexts: the kernel cuts each context's keys into cells, tasks of their own, and
    combines them; a short sequence next to a long one, or a window, leaves some cells empty."""
    from llmd.kernels import attention_cpu, attention_ref

    g = torch.Generator().manual_seed(sum(seq_lens) + num_kv_heads)
    block_size, head_dim, num_heads = 16, 64, 3 * num_kv_heads
    width = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * width + 4
    k_cache = to_cache(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g), cache_dtype)
    v_cache = to_cache(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g), cache_dtype)
    tables = torch.randperm(num_blocks, generator=g)[:len(seq_lens) * width].reshape(len(seq_lens), width)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    got = attention_cpu.decode_attention(query, k_cache, v_cache, seq_lens, tables, 0.125, window, lib)
    want = attention_ref.decode_attention(query, k_cache, v_cache, seq_lens, tables, 0.125, window)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("layout", [[(14, 5)], [(298, 6)], [(40, 1), (98, 5), (1, 1), (15, 3)]],
                         ids=["block-edge", "split-keys", "mixed"])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_attention_over_verified_spans_matches_reference(lib, cache_dtype, layout: list[tuple[int, int]],
                                                                window: int | None) -> None:
    """Speculative verification's rows: a span of consecutive positions of one sequence (the same
    block table), each row seeing keys up to itself, read once for the span. A span across a block
    edge, one long enough that its keys are split between threads (with a window, so that some rows'
    parts are empty), spans beside lone rows."""
    from llmd.kernels import attention_cpu, attention_ref

    g = torch.Generator().manual_seed(sum(n for n, _ in layout) + (window or 0))
    block_size, head_dim, num_kv_heads, num_heads = 16, 64, 3, 9
    width = max(-(-(start + n) // block_size) for start, n in layout)
    num_blocks = len(layout) * width + 2
    k_cache = to_cache(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g), cache_dtype)
    v_cache = to_cache(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g), cache_dtype)
    own = torch.randperm(num_blocks, generator=g)[:len(layout) * width].reshape(len(layout), width)
    # row r of a span (start, n): the sequence's table, length start + r + 1
    tables = torch.cat([own[i:i + 1].expand(n, -1) for i, (_, n) in enumerate(layout)])
    seq_lens = [start + r + 1 for start, n in layout for r in range(n)]
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    spans = torch.zeros(lib.llmd_attention_spans_size(len(seq_lens)), dtype=torch.long)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    num_spans = lib.llmd_attention_spans(tables.data_ptr(), width, lens.data_ptr(), len(seq_lens), block_size,
                                         num_kv_heads, spans.data_ptr())
    assert num_spans == len(layout)  # found exactly the spans laid out
    got = attention_cpu.decode_attention(query, k_cache, v_cache, seq_lens, tables, 0.125, window, lib)
    want = attention_ref.decode_attention(query, k_cache, v_cache, seq_lens, tables, 0.125, window)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


# around the cells' edges: 128 keys up to 2048, then 256 (kernels/cpu/paged_attention.c, cell_keys)
INVARIANCE_LENS = [1, 2, 127, 128, 129, 255, 300, 2047, 2048, 2049, 3001]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("window", [None, 100, 1000])
def test_decode_attention_is_the_same_bits_whatever_the_batch(lib, cache_dtype, window: int | None) -> None:
    """Batch invariance: a row's attention is the same bits alone, beside other sequences, and as one
    of a verified span of drafts (which reads its context once for the span). Greedy tokens then do
    not change with speculation on or off, nor with the load (issue 22); splitting a context by the
    thread count and the batch, as the kernel once did, changed them."""
    from llmd.kernels import attention_cpu

    g = torch.Generator().manual_seed(11 + (window or 0))
    block_size, head_dim, num_kv_heads, num_heads, span = 16, 64, 3, 9, 4
    width = -(-(max(INVARIANCE_LENS) + span) // block_size)
    num_blocks = len(INVARIANCE_LENS) * width
    k_cache = to_cache(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 2, cache_dtype)
    v_cache = to_cache(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g), cache_dtype)
    tables = torch.randperm(num_blocks, generator=g).reshape(len(INVARIANCE_LENS), width)
    # every sequence's rows at lengths n .. n + span - 1, each with its own query
    rows = [(i, n + r) for i, n in enumerate(INVARIANCE_LENS) for r in range(span)]
    query = torch.randn(len(rows), num_heads, head_dim, generator=g)

    def attend(picked: list[int], threads: int) -> torch.Tensor:
        # NOTE: the suite runs on one thread (OMP_NUM_THREADS=1), where a split by the thread count
        # never happened: the batches below run on 2 and 3
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return attention_cpu.decode_attention(query[picked], k_cache, v_cache, [rows[j][1] for j in picked],
                                                  tables[[rows[j][0] for j in picked]], 0.125, window, lib)
        finally:
            torch.set_num_threads(before)

    alone = torch.cat([attend([j], 1) for j in range(len(rows))])
    for threads in (2, 3):
        assert torch.equal(attend(list(range(len(rows))), threads), alone)  # every sequence's span in one batch
        firsts = list(range(0, len(rows), span))
        assert torch.equal(attend(firsts, threads), alone[firsts])  # one row per sequence, a decode step's batch
        for i in range(len(INVARIANCE_LENS)):  # each span alone, a step of one stream verifying drafts
            own = list(range(i * span, (i + 1) * span))
            assert torch.equal(attend(own, threads), alone[own]), (INVARIANCE_LENS[i], threads)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_kv_rows_are_stored_as_the_reference_stores_them(lib, cache_dtype) -> None:
    """The decode step's K/V writes (kv_row.h) against llmd.kernels.kv_format, bit for bit: rows of
    every magnitude (an fp16 scale that is subnormal, one near its top), zeros, ties."""
    from llmd.kernels.decode_cpu import CACHE_KINDS
    from llmd.kernels.kv_format import row_width

    g = torch.Generator().manual_seed(3)
    head_dim = 40  # not a multiple of 8: the vector loops' tails
    rows = torch.randn(64, head_dim, generator=g) * torch.logspace(-7, 3, 64)[:, None]
    rows[0] = 0.0
    rows[1, :] = 2.5  # every value a tie of round-half-even after scaling ... and the amax
    rows[2, :4] = torch.tensor([127.0, -63.5, 0.5, -0.5])
    want = to_cache(rows, cache_dtype)
    got = torch.empty(64, row_width(head_dim, cache_dtype), dtype=cache_dtype)
    lib.llmd_kv_store_rows(rows.contiguous().data_ptr(), 64, head_dim, CACHE_KINDS[cache_dtype], got.data_ptr())
    assert torch.equal(got.view(torch.uint8) if cache_dtype == torch.int8 else got,
                       want.view(torch.uint8) if cache_dtype == torch.int8 else want)


def test_the_native_kv_write_is_the_reference_s(lib) -> None:
    """Prompt chunks' K/V into an int8 cache (llmd.kernels.attention_cpu.write_kv): the same bytes at
    the same slots as the reference's write, a padding slot (-1) writing nothing."""
    from llmd.kernels import attention_cpu, attention_ref

    g = torch.Generator().manual_seed(4)
    key, value = torch.randn(20, 3, 64, generator=g) * 5, torch.randn(20, 3, 64, generator=g)
    slots = torch.randperm(64, generator=g)[:20]
    slots[7] = -1
    caches = [tuple(torch.zeros(4, 16, 3, 66, dtype=torch.int8) for _ in range(2)) for _ in range(2)]
    keep = slots >= 0
    attention_ref.write_kv(*caches[0], key[keep], value[keep], slots[keep])
    attention_cpu.write_kv(*caches[1], key, value, slots, lib)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert caches[1][0].view(-1, 3, 66).abs().sum(dim=(1, 2)).count_nonzero() == 19
