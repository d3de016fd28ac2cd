"""The Triton attention kernels (KV write, decode with split-K, extend), run by the Triton interpreter on
the CPU, against the torch reference in ``llmd.kernels.attention_ref`` on ragged batches over paged
caches whose blocks are scattered through the pool."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gpu_compile import compile_for_gpu

from llmd.kernels import attention_ref as ref
from llmd.kernels import attention_triton as at

# max |out - ref|. fp32: summation order and exp2 vs exp only (measured <= 2e-6). fp16: the
# kernels round the probabilities to fp16 before P @ V, as flash attention does (measured <= 1.2e-3).
# A wrong key (another block, another KV head, one past the causal edge) is off by ~0.1 or more.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3}

# (num_kv_heads, GQA group, head_dim, block_size, dtype): every GQA ratio 1/3/4/8, head dim 64/80/96/128,
# block size 16/32; fp16 in two (bf16 tl.dot is wrong in the interpreter, triton#11584).
CASES = [
    (2, 1, 64, 16, torch.float32),
    (1, 3, 80, 32, torch.float32),
    (2, 4, 96, 16, torch.float32),
    (1, 8, 128, 32, torch.float32),
    (3, 3, 64, 32, torch.float16),
    (2, 8, 80, 16, torch.float16),
]
SEQ_LENS = [1, 15, 16, 17, 100]


def case_id(value: object) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, H, D], a strided view (as q is, split from the fused qkv projection)
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]

    @property
    def query_start_loc(self) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(self.query_lens).cumsum(0).tolist()], dtype=torch.int32)

    @property
    def seq_lens_t(self) -> torch.Tensor:
        return torch.tensor(self.seq_lens, dtype=torch.int32)


def paged_batch(query_lens: list[int], seq_lens: list[int], num_kv_heads: int, group: int, head_dim: int,
                block_size: int, dtype: torch.dtype, seed: int) -> PagedBatch:
    """A random cache whose sequences own disjoint blocks in shuffled order (and some blocks nobody
    owns), block tables padded with ids of other sequences' blocks, and a strided query."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(blocks_per_seq) + 2
    tables, used = [], 0
    for n in blocks_per_seq:
        own = order[used:used + n]
        used += n
        tables.append(own + order[-(width - n):])  # padding: blocks the sequence must never read
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    heads = num_kv_heads * group
    qkv = torch.randn(sum(query_lens), heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    return PagedBatch(qkv[:, :heads], k_cache, v_cache, torch.tensor(tables), list(query_lens), list(seq_lens))


def max_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    return (out.float() - expected.float()).abs().max().item()


def reference(batch: PagedBatch, window: int | None = None) -> torch.Tensor:
    # fp32 reference, whatever the kernels' dtype
    return ref.paged_attention(batch.query.float(), batch.k_cache.float(), batch.v_cache.float(), batch.query_lens,
                               batch.seq_lens, batch.block_tables, batch.query.shape[-1] ** -0.5, window)


def run_decode(batch: PagedBatch, window: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    return at.decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens_t,
                               max(batch.seq_lens), batch.query.shape[-1] ** -0.5, window, num_splits)


def run_extend(batch: PagedBatch, window: int | None = None) -> torch.Tensor:
    return at.extend_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
                               batch.seq_lens_t, max(batch.query_lens), batch.query.shape[-1] ** -0.5, window)


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size", "dtype"), CASES, ids=case_id)
def test_decode_matches_reference(num_kv_heads: int, group: int, head_dim: int, block_size: int,
                                  dtype: torch.dtype) -> None:
    batch = paged_batch([1] * len(SEQ_LENS), SEQ_LENS, num_kv_heads, group, head_dim, block_size, dtype, seed=1)
    expected = reference(batch)
    # default split count, one split, a count that does not divide the blocks, more splits than blocks
    for splits in (None, 1, 3, 8):
        out = run_decode(batch, num_splits=splits)
        assert out.dtype == dtype and out.shape == batch.query.shape
        assert max_err(out, expected) < TOLERANCE[dtype], f"num_splits={splits}"


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size", "dtype"), CASES, ids=case_id)
def test_extend_matches_reference(num_kv_heads: int, group: int, head_dim: int, block_size: int,
                                  dtype: torch.dtype) -> None:
    # chunks of every length next to cached prefixes of 0 and of non-multiples of the block size
    # (a prefix hit or earlier chunks); a length-1 chunk is a decode row in a mixed step
    query_lens = SEQ_LENS
    contexts = [0, 0, 7, 21, 35]
    seq_lens = [q + c for q, c in zip(query_lens, contexts)]
    batch = paged_batch(query_lens, seq_lens, num_kv_heads, group, head_dim, block_size, dtype, seed=2)
    out = run_extend(batch)
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert max_err(out, reference(batch)) < TOLERANCE[dtype]


def test_extend_long_chunk_after_long_prefix() -> None:
    # several BLOCK_M tiles per chunk (100 > 64) behind 3 blocks of context, plus a decode row
    batch = paged_batch([100, 1], [150, 40], 2, 2, 64, 16, torch.float32, seed=3)
    assert max_err(run_extend(batch), reference(batch)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window(window: int) -> None:
    decode = paged_batch([1] * len(SEQ_LENS), SEQ_LENS, 2, 3, 64, 16, torch.float32, seed=4)
    for splits in (1, 4):
        assert max_err(run_decode(decode, window, splits), reference(decode, window)) < 1e-5
    extend = paged_batch([17, 100, 1], [40, 130, 60], 2, 3, 64, 16, torch.float32, seed=5)
    assert max_err(run_extend(extend, window), reference(extend, window)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=case_id)
def test_write_kv_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    k_cache = torch.randn(6, 16, 3, 80, generator=g).to(dtype)
    v_cache = torch.randn(6, 16, 3, 80, generator=g).to(dtype)
    # key/value as the model makes them: strided views of one fused qkv output, fp32 into the cache dtype
    qkv = torch.randn(5, 4 + 2 * 3, 80, generator=g)
    key, value = qkv[:, 4:7], qkv[:, 7:]
    slots = torch.tensor([0, 17, 95, -1, 40])  # -1: a padding token, written nowhere
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    ref.write_kv(expected_k, expected_v, key[keep], value[keep], slots[keep])
    at.write_kv(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_int8_write_kv_is_the_references_bytes() -> None:
    """An int8 cache (llmd.kernels.kv_format): the kernel quantises each new row as the reference does,
    bit for bit: rows of every magnitude (subnormal fp16 scales), zeros, ties of round-half-even, a
    head size the tile pads (80 in 128), fp32 and fp16 inputs; a padding slot writes nothing."""
    g = torch.Generator().manual_seed(8)
    num_kv_heads, head_dim, tokens = 3, 80, 40
    for dtype in (torch.float32, torch.float16):
        key = torch.randn(tokens, num_kv_heads, head_dim, generator=g) * torch.logspace(-5, 3, tokens)[:, None, None]
        value = torch.randn(tokens, num_kv_heads, head_dim, generator=g)
        key[0], key[1, :, :] = 0.0, 2.5  # a zero row; a row of ties (2.5 / (2.5 / 127) = 127 exactly, others)
        value[2, 0, :4] = torch.tensor([127.0, -63.5, 0.5, -0.5])
        key, value = key.to(dtype), value.to(dtype)
        slots = torch.randperm(4 * 16, generator=g)[:tokens]
        slots[5] = -1
        shape = (4, 16, num_kv_heads, head_dim + 2)
        want_k, want_v = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
        keep = slots >= 0
        ref.write_kv(want_k, want_v, key[keep], value[keep], slots[keep])
        k_cache, v_cache = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
        at.write_kv(k_cache, v_cache, key, value, slots)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), dtype


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size", "dtype"),
                         [CASES[0], CASES[1], CASES[4]], ids=case_id)
def test_int8_cache_decode_and_extend_match_reference(num_kv_heads: int, group: int, head_dim: int,
                                                      block_size: int, dtype: torch.dtype) -> None:
    """The decode kernel (every split count) and the extend kernel (chunks after cached prefixes, a
    window) over an int8 cache, against the reference reading the same int8 rows."""
    from llmd.kernels import kv_format

    query_lens, seq_lens = [1, 7, 16, 3], [40, 30, 16, 100]
    batch = paged_batch(query_lens, seq_lens, num_kv_heads, group, head_dim, block_size, dtype, seed=head_dim)
    batch.k_cache = kv_format.to_cache(batch.k_cache.float() * 3, torch.int8)
    batch.v_cache = kv_format.to_cache(batch.v_cache.float(), torch.int8)
    scale = head_dim ** -0.5
    for window in (None, 9):
        expected = ref.paged_attention(batch.query.float(), batch.k_cache, batch.v_cache, batch.query_lens,
                                       batch.seq_lens, batch.block_tables, scale, window)
        assert max_err(run_extend(batch, window), expected) < TOLERANCE[dtype], window
    decode = paged_batch([1] * len(SEQ_LENS), SEQ_LENS, num_kv_heads, group, head_dim, block_size, dtype, seed=3)
    decode.k_cache = kv_format.to_cache(decode.k_cache.float() * 3, torch.int8)
    decode.v_cache = kv_format.to_cache(decode.v_cache.float(), torch.int8)
    expected = ref.decode_attention(decode.query.float(), decode.k_cache, decode.v_cache, decode.seq_lens,
                                    decode.block_tables, scale)
    for splits in (None, 1, 3):
        assert max_err(run_decode(decode, None, splits), expected) < TOLERANCE[dtype], splits
    # a canary: the same rows read as if every scale were 1.5x: far outside the tolerance
    scales = decode.k_cache[..., -2:].contiguous().view(torch.float16)
    decode.k_cache[..., -2:] = (scales * 1.5).view(torch.int8)
    assert max_err(run_decode(decode), expected) > 20 * TOLERANCE[dtype]


def test_stale_inf_and_nan_past_the_sequence_stay_out() -> None:
    # A reused block keeps what its last owner wrote; an fp16 overflow there (inf) or NaN must not
    # reach a sequence whose keys end before it (probability 0 times inf is NaN).
    for query_lens, seq_lens, run in (([1] * 4, [5, 17, 30, 33], run_decode),
                                      ([5, 17, 3, 1], [5, 20, 30, 33], run_extend)):
        batch = paged_batch(query_lens, seq_lens, 2, 2, 64, 16, torch.float32, seed=8)
        expected = reference(batch)
        for row, length in enumerate(seq_lens):
            block = batch.block_tables[row, (length - 1) // 16]
            batch.k_cache[block, length % 16 or 16:] = float("nan")
            batch.v_cache[block, length % 16 or 16:] = float("inf")
        for out in (run(batch),) if run is run_extend else (run(batch, None, 1), run(batch, None, 2)):
            assert out.isfinite().all() and max_err(out, expected) < 1e-5
        assert max_err(reference(batch), expected) < 1e-5  # the torch reference too


def test_a_row_without_keys_gives_zeros_not_nan() -> None:
    """seq_len 0 (nothing the engine sends; a padded row could): every split is empty, and the
    combine must not divide 0 by 0; the other rows are untouched by it."""
    batch = paged_batch([1, 1], [40, 1], 2, 2, 64, 16, torch.float32, seed=9)
    expected = reference(batch)
    batch.seq_lens = [40, 0]
    for splits in (1, 4):
        out = run_decode(batch, num_splits=splits)
        assert out.isfinite().all(), splits
        assert torch.equal(out[1], torch.zeros_like(out[1])) and max_err(out[0], expected[0]) < 1e-5


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in fp32 (llmd.daemon.models.layers' formula) of ``x [T, heads, D]``."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    x = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * emb.cos()[:, None, :] + rotated * emb.sin()[:, None, :]


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


# every case plain; the q/k norm and a sliding window on GQA 3 (fp32) and 8 (fp16)
QKV_CASES = [(*case, "plain") for case in CASES] + [(*CASES[1], "qk_norm+window"), (*CASES[5], "qk_norm+window")]


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size", "dtype", "variant"), QKV_CASES,
                         ids=case_id)
def test_decode_from_the_qkv_projection(num_kv_heads: int, group: int, head_dim: int, block_size: int,
                                        dtype: torch.dtype, variant: str) -> None:
    check_decode_from_qkv(num_kv_heads, group, head_dim, block_size, dtype, variant, torch.device("cpu"),
                          TOLERANCE[dtype])


def check_decode_from_qkv(num_kv_heads: int, group: int, head_dim: int, block_size: int, dtype: torch.dtype,
                          variant: str, device: torch.device, tolerance: float) -> None:
    """The fused decode attention (RoPE, q/k norm, KV write, attention over context + new token)
    on ``device`` against the reference chain on the CPU: RoPE in fp32, the new K/V written, then
    paged attention. A padding row (slot -1, a context of 1) writes nothing; every split count;
    the cache outside the new tokens' slots is untouched, bit for bit (also tests/test_gpu.py)."""
    g = torch.Generator().manual_seed(head_dim + group)
    seq_lens = [*SEQ_LENS, 1]
    batch = paged_batch([1] * len(seq_lens), seq_lens, num_kv_heads, group, head_dim, block_size, dtype, seed=10)
    heads = num_kv_heads * group
    qkv = torch.randn(len(seq_lens), (heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.tensor(seq_lens) - 1
    slots = torch.tensor([int(batch.block_tables[i, p // block_size]) * block_size + p % block_size
                          for i, p in enumerate(positions.tolist())])
    slots[-1] = -1  # the padding row
    inv_freq = 1.0 / (10_000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    window, norms, eps = (None, (None, None), 0.0) if variant == "plain" else \
        (20, (torch.randn(head_dim, generator=g).to(dtype), torch.randn(head_dim, generator=g).to(dtype)), 1e-6)
    q, k, v = qkv.view(len(seq_lens), -1, head_dim).split([heads, num_kv_heads, num_kv_heads], dim=1)
    if norms[0] is not None:
        q, k = rms_norm_ref(q, norms[0], eps), rms_norm_ref(k, norms[1], eps)
    q, k = rope_ref(q, positions, inv_freq), rope_ref(k, positions, inv_freq)
    want_k, want_v = batch.k_cache.float(), batch.v_cache.float()
    keep = slots >= 0
    ref.write_kv(want_k, want_v, k[keep], v[keep].float(), slots[keep])
    expected = ref.paged_attention(q, want_k, want_v, batch.query_lens, seq_lens, batch.block_tables,
                                   head_dim ** -0.5, window)
    written = torch.zeros(want_k.shape[:2], dtype=torch.bool)
    written.view(-1)[slots[keep]] = True
    dev = lambda t: None if t is None else t.to(device)
    for splits in (1, 3, 8):  # one (stored directly), a count not dividing the blocks, more than blocks
        k_cache, v_cache = batch.k_cache.clone().to(device), batch.v_cache.clone().to(device)
        out = at.decode_attention_new_token(
            qkv.to(device), k_cache, v_cache, batch.block_tables.to(device), batch.seq_lens_t.to(device),
            positions.to(device), slots.to(device), inv_freq.to(device), max(seq_lens), head_dim ** -0.5, window,
            dev(norms[0]), dev(norms[1]), eps, num_splits=splits)
        out, k_cache, v_cache = out.cpu(), k_cache.cpu(), v_cache.cpu()
        assert out.dtype == dtype and out.shape == (len(seq_lens), heads, head_dim)
        # the rotated K rounds to the dtype (fp16: 2^-11 of |k| ~ 3, the norm's weight included)
        assert max_err(out[keep], expected[keep]) < 2 * tolerance, f"num_splits={splits}"
        assert out[~keep].isfinite().all()  # the padding row: its own token (not in the cache) only
        assert max_err(k_cache[written], want_k[written]) < tolerance * 4
        assert torch.equal(v_cache[written], want_v[written].to(dtype))
        assert torch.equal(k_cache[~written], batch.k_cache[~written])
        assert torch.equal(v_cache[~written], batch.v_cache[~written])
    assert int(at.arrival_counters(device, 1).abs().sum()) == 0, "every counter reset for the next launch"


def test_the_bound_decode_checks_every_new_cache() -> None:
    """NewTokenDecode (the decode step's attention) checks a KV cache the first time it sees it,
    not at every call; a different cache is checked again, and ``out`` is written when given."""
    batch = paged_batch([1, 1], [5, 9], 2, 2, 64, 16, torch.float32, seed=11)
    attention = at.NewTokenDecode(4, 2, 64, torch.ones(32), 0.125)
    qkv = torch.randn(2, 8 * 64)
    args = (batch.block_tables, batch.seq_lens_t, torch.tensor([4, 8]), torch.tensor([-1, -1]), 9)
    out = torch.empty(2, 4, 64)
    assert attention(qkv, batch.k_cache, batch.v_cache, *args, out) is out and out.isfinite().all()
    with pytest.raises(ValueError, match="must hold 2 heads of 64 in torch.float32"):
        attention(qkv, batch.k_cache[..., :32].contiguous(), batch.v_cache[..., :32].contiguous(), *args)
    with pytest.raises(ValueError, match="out must be"):
        attention(qkv, batch.k_cache, batch.v_cache, *args, torch.empty(2, 4, 32))
    with pytest.raises(ValueError, match="q_norm and k_norm come together"):
        at.NewTokenDecode(4, 2, 64, torch.ones(32), 0.125, q_norm=torch.ones(64))


def test_unsupported_shapes() -> None:
    assert at.unsupported(16, 128, torch.bfloat16) is None and at.unsupported(32, 80, torch.float32) is None
    for block_size in (8, 24, 64):
        assert "block size of 16 or 32" in at.unsupported(block_size)
    assert "head_dim up to 128" in at.unsupported(16, 256)
    assert "float16, bfloat16 or float32" in at.unsupported(16, 64, torch.float64)


def test_decode_splits_heuristic() -> None:
    # few sequences, long context: split up to MAX_SPLITS; many sequences or short context: no split
    assert at.decode_splits(1, 2, 4096, 16) == at.MAX_SPLITS
    assert at.decode_splits(64, 8, 4096, 16) == 1
    assert at.decode_splits(1, 2, 16 * at.MIN_BLOCKS_PER_SPLIT, 16) == 1
    assert at.decode_splits(1, 2, 16 * at.MIN_BLOCKS_PER_SPLIT * 3, 16) == 2  # 3 rounds down to a power of two
    for batch in (1, 3, 17, 64):
        for length in (1, 100, 1000, 10_000):
            splits = at.decode_splits(batch, 3, length, 16)
            assert splits >= 1 and splits & (splits - 1) == 0


def test_invalid_inputs_raise() -> None:
    batch = paged_batch([1, 1], [5, 9], 2, 2, 64, 16, torch.float32, seed=7)
    args = dict(query=batch.query, k_cache=batch.k_cache, v_cache=batch.v_cache, block_tables=batch.block_tables,
                seq_lens=batch.seq_lens_t, max_seq_len=9, scale=0.125)
    bad = [
        (dict(query=torch.randn(2, 3, 64)), "multiple of the cache's 2 KV heads"),
        (dict(query=torch.randn(2, 4, 32)), "query must be"),
        (dict(query=batch.query.to(torch.int32)), "float16, bfloat16 or float32"),
        (dict(k_cache=batch.k_cache[:, :8].contiguous(), v_cache=batch.v_cache[:, :8].contiguous()), "block size"),
        (dict(k_cache=batch.k_cache.double(), v_cache=batch.v_cache.double()), "float16, bfloat16, float32 or int8"),
        (dict(v_cache=batch.v_cache.half()), "one shape and dtype"),
        (dict(k_cache=batch.k_cache.transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
        (dict(seq_lens=batch.seq_lens_t[:1]), "seq_lens"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(num_splits=0), "num_splits"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            at.decode_attention(**(args | change))
    qkv = torch.randn(2, (4 + 2 * 2) * 64)
    new = dict(qkv=qkv, k_cache=batch.k_cache, v_cache=batch.v_cache, block_tables=batch.block_tables,
               seq_lens=batch.seq_lens_t, positions=torch.tensor([4, 8]), slot_mapping=torch.tensor([3, 40]),
               inv_freq=torch.ones(32), max_seq_len=9, scale=0.125)
    bad = [
        (dict(qkv=torch.randn(2, 4 * 64)), "qkv must be"),  # no room for k and v
        (dict(qkv=torch.randn(2, 7 * 64)), "qkv must be"),  # 3 query heads on 2 KV heads
        (dict(qkv=qkv.T.contiguous().T), "contiguous"),
        (dict(positions=torch.tensor([4])), "positions must be"),
        (dict(slot_mapping=torch.tensor([3.0, 4.0])), "slot_mapping must be"),
        (dict(inv_freq=torch.ones(64)), "inv_freq must be"),
        (dict(q_norm=torch.ones(64)), "come together"),
        (dict(q_norm=torch.ones(32), k_norm=torch.ones(32)), "q_norm must be"),
        (dict(num_splits=0), "num_splits"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            at.decode_attention_new_token(**(new | change))
    with pytest.raises(ValueError, match="query_start_loc"):
        at.extend_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                            torch.tensor([0, 1], dtype=torch.int32), batch.seq_lens_t, 1, 0.125)
    with pytest.raises(ValueError, match="slot_mapping"):
        at.write_kv(batch.k_cache, batch.v_cache, batch.query[:, :2], batch.query[:, :2], torch.tensor([0]))


# Every kernel compiled for every GPU generation (see gpu_compile.py) as the runtime launches it: the
# alignment hints it sees (pointers and strides, but the unspecialised block-table width), the extend
# kernel's warps and its largest tile for the architecture; in gpu_compile's dtypes; decode as fed
# by the qkv projection (RoPE, q/k norm, KV write) and not, with and without a sliding window;
# extend for a GQA group of 1 and of 3 (padded to 4). Each must fit in the shared memory of every
# card of its architecture and spill no registers.
COMPILE_FOR_GPU = """
import llmd.kernels.attention_triton as at
import torch

# Shared memory per block, at most: Turing 64 KiB, A100 163, consumer Ampere/Ada 99, Hopper 227.
SHARED_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 90: 227 * 1024}
strides = ["stride_qt", "stride_qh", "stride_bt", "stride_cb", "stride_cs", "stride_ch", "stride_ot", "stride_oh"]
common = dict({s: "i32" for s in strides}, block_tables_ptr="*i64", seq_lens_ptr="*i32", scale_log2="fp32",
              window="i32")
def aligned(sig):
    return [n for n in sig if n.endswith("_ptr") or (n.startswith("stride_") and n != "stride_bt")]

block_n, head_dim = at.MAX_BLOCK_SIZE, at.MAX_HEAD_DIM
reports = []
for arch in ARCHS:
    for dt in dtypes(arch):
        torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dt]
        kernels = []
        # an int8 cache (rows of values and an fp16 scale, read through an int16 view) on sm_80 bf16
        for int8 in (False, True) if (arch, dt) == (80, "bf16") else (False,):
            kv = "i8" if int8 else dt
            scales = dict(k_scale_ptr="*i16" if int8 else f"*{dt}", v_scale_ptr="*i16" if int8 else f"*{dt}")
            cache = dict(q_ptr=f"*{dt}", k_cache_ptr=f"*{kv}", v_cache_ptr=f"*{kv}", out_ptr=f"*{dt}", **scales)
            tag = " int8" if int8 else ""
            sig = dict(key_ptr="*fp32", value_ptr="*fp32", k_cache_ptr=f"*{kv}", v_cache_ptr=f"*{kv}", **scales,
                       slot_ptr="*i64", block_size="i32", stride_kt="i32", stride_kh="i32", stride_vt="i32",
                       stride_vh="i32", stride_cb="i32", stride_cs="i32", stride_ch="i32")
            kernels.append(("write_kv" + tag, compile_for(at._write_kv_kernel, sig,
                                                          dict(NUM_KV_HEADS=3, HEAD_DIM=80, INT8=int8, BLOCK_H=4,
                                                               BLOCK_D=128), arch, aligned(sig))))
            for new_kv, sliding in ((False, False), (True, True)):  # the split count is a runtime argument
                if int8 and new_kv:
                    continue  # the fused decode step writes the model's dtype only
                sig = dict(common, **cache, pos_ptr="*i64", slot_ptr="*i64", inv_freq_ptr="*fp32",
                           q_norm_ptr=f"*{dt}", k_norm_ptr=f"*{dt}", part_ptr="*fp32", lse_ptr="*fp32",
                           count_ptr="*i32", eps="fp32", num_splits="i32")
                kernels.append((f"decode new_kv={new_kv} window={sliding}{tag}", compile_for(
                    at._decode_kernel, sig, dict(GROUP=8, HEAD_DIM=head_dim, SLIDING=sliding, NEW_KV=new_kv,
                                                 QK_NORM=new_kv, INT8=int8, BLOCK_G=16, BLOCK_D=head_dim,
                                                 BLOCK_N=block_n),
                    arch, aligned(sig), num_warps=at.TURING_DECODE_NUM_WARPS if arch < 80 else 4)))
                sig = dict(common, **cache, query_start_ptr="*i32")
                for group in (1, 3):  # tiles of 64 tokens x 1 head, 16 x 4 (a group of 3 padded to 4)
                    block_t, block_g, keys = at.extend_tile(4096, group, torch_dtype, (arch // 10, arch % 10))
                    kernels.append((f"extend window={sliding} {block_t}x{block_g} rows, {keys} keys{tag}",
                                    compile_for(at._extend_kernel, sig,
                                                dict(GROUP=group, HEAD_DIM=head_dim, SLIDING=sliding, INT8=int8,
                                                     BLOCK_T=block_t, BLOCK_G=block_g, BLOCK_D=head_dim,
                                                     BLOCK_N=keys, KV_BLOCK=block_n), arch, aligned(sig),
                                                num_warps=at.EXTEND_NUM_WARPS)))
        for label, kernel in kernels:
            r = ptxas_report(kernel)
            print(label, dt, r)
            reports.append((label, dt, r))
for label, dt, r in reports:
    assert r["shared"] <= SHARED_LIMIT[r["arch"]], (label, dt, r)
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (label, dt, r)
    assert r["vector_loads"], (label, dt, r)
"""


def test_kernels_compile_for_every_gpu_generation(tmp_path: Path) -> None:
    out = compile_for_gpu(COMPILE_FOR_GPU, tmp_path)
    # sm_75, sm_80, sm_86/90; + int8: write, decode, 2 extends
    assert out.count("'registers'") == 7 * (1 + 3 + 2 * 1) + 4, out[-2000:]
