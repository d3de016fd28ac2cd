"""The int8 KV cache (issue 23, ``--kv-cache-dtype int8``): rows of int8 values with an fp16 scale
each (llmd.kernels.kv_format), written and read by the torch reference, the native decode attention
and the fused native decode step; the pool holds ~2x the tokens of bf16 in the same memory; prefix
hits, chunked prompts, preemption and speculative rollback behave as with any cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_engine, make_hf_model, run_engine, save_hf_model

from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.kernels import attention_ref, kv_format

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("kv8") / "m", with_tokenizer=True)


def test_rows_round_trip_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 64, generator=g) * torch.logspace(-4, 4, 500)[:, None]
    x[0] = 0.0
    rows = kv_format.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (500, 66)
    scale = rows[:, -2:].contiguous().view(torch.float16).float()  # [500, 1]
    back = kv_format.dequantize_rows(rows)
    assert torch.equal(back[0], torch.zeros(64))  # a zero row stays zero (scale 0)
    assert (scale * 127 >= x.abs().amax(dim=-1, keepdim=True)).all()  # the scale rounded up: no value clipped
    assert (back - x).abs().le(scale / 2 * (1 + 1e-6)).all()  # rounding to nearest, no worse
    assert rows[:, :-2].abs().max() == 127  # the row's largest value takes the full range
    assert kv_format.head_dim_of(rows) == 64 and kv_format.row_bytes(64, torch.int8) == 66


def test_reference_attention_over_an_int8_cache_is_the_fp32_one_within_the_rounding() -> None:
    """A ragged batch: prompt chunks after cached prefixes, a whole prompt, decode rows, a sliding
    window; the same K/V written to an fp32 cache and an int8 one. The int8 cache's error is what its
    rounding allows, and a cache of 4-bit values (the canary) is several times worse."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, bs = 6, 2, 32, 4
    query_lens, seq_lens = [5, 1, 9, 1, 3], [12, 30, 9, 7, 20]  # chunk after a 7-token prefix, decode, ...
    tables = torch.stack([torch.randperm(48, generator=g)[:8] for _ in query_lens])
    # the context's K/V written by earlier steps (prefixes), then this step's
    total = sum(seq_lens)
    keys, values = torch.randn(total, kv_heads, dim, generator=g), torch.randn(total, kv_heads, dim, generator=g)
    slots = torch.cat([tables[i, torch.arange(n) // bs] * bs + torch.arange(n) % bs for i, n in enumerate(seq_lens)])
    query = torch.randn(sum(query_lens), heads, dim, generator=g)

    def attend(cache_dtype: torch.dtype, window: int | None) -> torch.Tensor:
        k_cache = torch.zeros(48, bs, kv_heads, kv_format.row_width(dim, cache_dtype), dtype=cache_dtype)
        v_cache = torch.zeros_like(k_cache)
        attention_ref.write_kv(k_cache, v_cache, keys, values, slots)
        return attention_ref.paged_attention(query, k_cache, v_cache, query_lens, seq_lens, tables, dim ** -0.5,
                                             window)

    for window in (None, 6):
        want = attend(torch.float32, window)
        err = (attend(torch.int8, window) - want).abs().max().item()
        assert err < 0.02, err
        real = kv_format.quantize_rows
        try:  # the canary: 4-bit values (the same layout, 7 levels a side) must show
            kv_format.quantize_rows = lambda x: _coarse(real, x)
            coarse = (attend(torch.int8, window) - want).abs().max().item()
        finally:
            kv_format.quantize_rows = real
        assert coarse > 5 * err, (coarse, err)


def _coarse(quantize, x: torch.Tensor) -> torch.Tensor:
    rows = quantize(x)
    scale = rows[..., -2:].contiguous().view(torch.float16) * (127 / 7)
    values = torch.round(rows[..., :-2].float() * 7 / 127) * (127 / 7)
    return torch.cat([values.round().to(torch.int8), scale.to(torch.float16).view(torch.int8)], dim=-1)


@pytest.mark.parametrize("native", [False, True], ids=["cpu-attention", "native-step"])
def test_the_native_kernels_generate_what_the_reference_does(model_dir, native: bool) -> None:
    """int8 caches both ways: the torch reference throughout, against the cpu backend's native decode
    attention (dense weights), or the fused native decode step (INT4, both paths on the same
    weights): the same greedy tokens through chunked prompts, prefix hits and mixed steps."""
    from llmd.daemon.attention import CpuAttentionBackend, TorchAttentionBackend
    from llmd.daemon.quantization import QuantConfig

    quant = QuantConfig("int4") if native else None
    config = dict(num_blocks=96, block_size=4, max_batched_tokens=24, kv_cache_dtype="int8", quant=quant)
    prefix = list(range(40, 60))
    requests = [(i % 3, f"r{i}", prefix[:4 * i] + [(7 * i + k) % 250 for k in range(10 + 3 * i)], GREEDY)
                for i in range(6)]
    reference = make_engine(model_dir, attention=TorchAttentionBackend(), **config)
    assert reference.model.decode_step is None
    expected = run_engine(reference, requests)
    engine = make_engine(model_dir, attention=CpuAttentionBackend(), **config)
    assert (engine.model.decode_step is not None) == native
    assert engine.runner.kv_caches[0][0].dtype == torch.int8
    if not native:
        assert run_engine(engine, requests) == expected
    else:  # the native step quantises its matmuls' activations: its logits differ in the last digits
        got = run_engine(engine, requests)
        assert sum(got[r] == expected[r] for r in expected) >= 4
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
    assert engine.stats().prefix_cache_hit_rate > 0


def test_the_triton_kernels_generate_what_the_reference_does(model_dir) -> None:
    """An int8 cache on the Triton backend (the interpreter here): its write, decode and extend kernels
    give the torch reference's greedy tokens through chunked prompts, prefix hits and mixed steps,
    keys centred. The fused Triton decode step writes the model's dtype only: decode steps go layer
    by layer."""
    pytest.importorskip("triton")
    from llmd.daemon.attention import TorchAttentionBackend, TritonAttentionBackend

    config = dict(num_blocks=96, block_size=16, max_batched_tokens=24, kv_cache_dtype="int8")
    # (the interpreter runs each launch's programs one by one: a few short requests)
    prefix, params = list(range(40, 80)), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    requests = [(2 * (i > 0), f"r{i}", prefix[:(i > 0) * 32] + [(7 * i + k) % 250 for k in range(10 + 3 * i)],
                 params) for i in range(3)]
    expected = run_engine(make_engine(model_dir, attention=TorchAttentionBackend(), **config), requests)
    engine = make_engine(model_dir, attention=TritonAttentionBackend(), **config)
    assert engine.model.decode_step is None and engine.runner.kv_caches[0][0].dtype == torch.int8
    assert engine.model.model.layers[0].self_attn.key_centre is not None
    assert run_engine(engine, requests) == expected
    assert engine.stats().prefix_cache_hit_rate > 0


def test_the_pool_holds_twice_the_tokens_of_bf16_in_the_same_memory(model_dir) -> None:
    from llmd.daemon.engine.model_runner import kv_block_bytes
    from llmd.daemon.model_config import ModelConfig

    blocks = {dtype: make_engine(model_dir, kv_cache_mb=1, kv_cache_dtype=dtype, dtype=torch.bfloat16).num_blocks
              for dtype in ("auto", "int8", "float32")}
    # the tiny model's heads are 16 wide: rows of 32 bytes in bf16, 18 in int8 (the scale is a larger share)
    assert blocks["int8"] / blocks["auto"] == pytest.approx(32 / 18, rel=0.01)
    assert blocks["float32"] / blocks["auto"] == pytest.approx(0.5, rel=0.01)

    class Default:  # the default model's shape (SmolLM2-135M): heads of 64
        config = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                             num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)

    ratio = kv_block_bytes(Default, 16, torch.bfloat16) / kv_block_bytes(Default, 16, torch.int8)
    assert ratio >= 1.9 and ratio == pytest.approx(128 / 66)


@pytest.mark.parametrize("config", [dict(num_blocks=24, block_size=4), dict(speculative="ngram")],
                         ids=["preempting", "speculating"])
def test_preemption_and_speculation_are_unchanged(model_dir, config: dict) -> None:
    """Greedy tokens are the same with speculation on as off and with a pool small enough to preempt
    as with a large one, on int8 caches (recomputed prefixes and rolled-back drafts rewrite rows)."""
    units = [[(i * 13 + k * 7) % 250 for k in range(5 + i % 3)] for i in range(4)]  # prompts that repeat
    requests = [(0, f"r{i}", (unit * 8)[:40], GREEDY) for i, unit in enumerate(units)]
    base = run_engine(make_engine(model_dir, kv_cache_dtype="int8", speculative="off"), requests)
    engine = make_engine(model_dir, kv_cache_dtype="int8", **({"speculative": "off"} | config))
    assert run_engine(engine, requests) == base
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
    if "num_blocks" in config:
        assert engine.scheduler.num_preemptions > 0
    else:
        assert engine.num_accepted_tokens > 0


def test_unload_and_reload_keep_the_int8_cache(model_dir) -> None:
    from llmd.daemon.loader import load_model
    from llmd.daemon.model_source import resolve_model

    engine = make_engine(model_dir, kv_cache_dtype="int8")
    before = run_engine(engine, [(0, "a", list(range(3, 30)), GREEDY)])
    engine.unload()
    engine.load(load_model(resolve_model(model_dir)).model)
    assert engine.runner.kv_caches[0][0].dtype == torch.int8
    assert run_engine(engine, [(0, "b", list(range(3, 30)), GREEDY)])["b"] == before["a"]


def test_a_backend_that_cannot_read_the_cache_is_a_clear_error(model_dir) -> None:
    pytest.importorskip("triton")
    from llmd.daemon.attention import TritonAttentionBackend

    reason = TritonAttentionBackend().unsupported_cache(torch.float16, torch.float32)
    assert "--kv-cache-dtype auto" in reason
    assert TritonAttentionBackend().unsupported_cache(torch.float32, torch.float32) is None
    assert TritonAttentionBackend().unsupported_cache(torch.int8, torch.bfloat16) is None
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16, int8"):
        make_engine(model_dir, kv_cache_dtype="fp4")


def test_an_fp16_cache_on_the_cpu_runs_layer_by_layer(model_dir) -> None:
    """The native kernels read fp32, bf16 and int8 rows: an fp16 cache takes the reference's decode
    attention and the layer-by-layer path, and still generates what an fp32 cache does, to fp16's
    rounding (the first tokens)."""
    from llmd.daemon.attention import CpuAttentionBackend
    from llmd.daemon.quantization import QuantConfig

    config = dict(attention=CpuAttentionBackend(), quant=QuantConfig("int4"))
    engine = make_engine(model_dir, kv_cache_dtype="float16", **config)
    assert engine.model.decode_step is None and engine.runner.kv_caches[0][0].dtype == torch.float16
    got = run_engine(engine, [(0, "a", list(range(3, 30)), GREEDY)])["a"]
    want = run_engine(make_engine(model_dir, **config), [(0, "a", list(range(3, 30)), GREEDY)])["a"]
    assert got[:4] == want[:4]


def test_status_names_the_cache() -> None:
    from llmd.commands.status import _kv_format

    assert _kv_format({"kv_cache_dtype": "int8", "kv_cache_tokens": 90368}) == "; int8, 90368 tokens"
    assert _kv_format({}) == ""  # an older daemon's info
