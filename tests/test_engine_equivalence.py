"""Greedy output must not depend on how the engine batches: prefix caching on or off, chunk size,
concurrency and arrival times, preemption. The reference is the unpaged one-sequence path, itself
checked against transformers in test_model_equivalence.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_engine, make_hf_model, run_engine, save_hf_model

from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.reference_generator import Generator

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(make_hf_model("qwen2"), tmp_path_factory.mktemp("eq") / "m", with_tokenizer=True)


def make_requests(num: int, seed: int = 0) -> list[tuple[int, str, list[int], SamplingParams]]:
    """Mixed lengths (1..90 tokens), some sharing a 40-token prefix, arriving over 12 steps."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 259, (40,), generator=g).tolist()
    reqs = []
    for i in range(num):
        length = int(torch.randint(1, 50, (1,), generator=g))
        tail = torch.randint(0, 259, (length,), generator=g).tolist()
        ids = shared + tail if i % 3 == 0 else tail
        reqs.append(((i * 5) % 12, f"r{i}", ids, GREEDY))
    return reqs


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> dict[str, list[int]]:
    engine = make_engine(tiny_dir, num_blocks=64)
    gen = Generator(engine.model)
    return {rid: list(gen.stream(ids, params)) for _, rid, ids, params in make_requests(16)}


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("chunk", [1, 7, 13, 4096])
def test_batching_does_not_change_greedy_output(tiny_dir: Path, reference, prefix_caching: bool, chunk: int) -> None:
    engine = make_engine(tiny_dir, num_blocks=128, block_size=16, max_batched_tokens=chunk,
                         prefix_cache=prefix_caching)
    got = run_engine(engine, make_requests(16))
    assert got == reference
    stats = engine.stats()
    assert stats.num_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    if prefix_caching:
        assert stats.prefix_cache_hit_rate > 0  # later arrivals reuse the shared prefix
    else:
        assert stats.prefix_cache_hit_rate == 0


def test_one_at_a_time_equals_concurrent(tiny_dir: Path, reference) -> None:
    engine = make_engine(tiny_dir, num_blocks=128)
    for _, rid, ids, params in make_requests(16):
        assert run_engine(engine, [(0, rid, ids, params)])[rid] == reference[rid]


@pytest.mark.parametrize("block_size", [4, 16])
def test_preemption_does_not_change_greedy_output(tiny_dir: Path, reference, block_size: int) -> None:
    # 120 tokens of pool for 16 requests of up to 114 tokens: preemption is certain.
    engine = make_engine(tiny_dir, num_blocks=480 // block_size // 4, block_size=block_size,
                         max_batched_tokens=64)
    got = run_engine(engine, make_requests(16))
    assert engine.scheduler.num_preemptions > 0
    assert got == reference
    assert engine.kv.usage.num_used == 0



def test_an_unpaced_engine_takes_its_whole_budget_however_slow_the_last_step(
        tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Which prompt tokens share a step must not hang on the machine's speed where nobody waits
    (``llmd.LLM``, whose perplexities the quality tests compare to 1%): there the budget is whole.
    The canary: the daemon's paced engine cuts the next step after the same slow one."""
    import llmd.daemon.engine.scheduler as scheduler_module
    from llmd import LLM

    class SlowClock:  # every step seems to take 10 s
        now = 0.0

        def monotonic(self) -> float:
            self.now += 5.0
            return self.now

    monkeypatch.setattr(scheduler_module, "time", SlowClock())
    ids = [3 + i % 200 for i in range(200)]
    for paced, want in ((False, 64), (True, scheduler_module.MIN_PACED_TOKENS)):
        engine = make_engine(tiny_dir, num_blocks=64, max_batched_tokens=64, paced=paced)
        engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=1))
        chunks = []
        for _ in range(3):
            batch = engine.scheduler.schedule()
            chunks.append(batch.num_tokens)
            engine.scheduler.update(batch, [None] * len(batch.seqs))
        assert chunks[0] == 64 and chunks[1:] == [want, want], (paced, chunks)
    assert LLM(str(tiny_dir), dtype="float32", quant="none").engine.scheduler.config.lone_step_seconds is None


POISONS = [
    pytest.param(dict(), id="reference"),
    pytest.param(dict(attention="cpu"), id="native-attention"),
    pytest.param(dict(attention="cpu", native=True, kv_cache_dtype="bfloat16"), id="native-step-bf16"),
    pytest.param(dict(attention="cpu", native=True, kv_cache_dtype="int8"), id="native-step-int8"),
    pytest.param(dict(kv_cache_dtype="int8", speculative="ngram"), id="reference-int8-ngram"),
]


@pytest.mark.parametrize("case", POISONS)
def test_a_pool_full_of_nan_changes_nothing(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, case: dict) -> None:
    """KV pools are not initialised (model_runner.new_kv_cache: their pages are mapped as blocks are
    first written), so no kernel may read a slot before it is written: with every byte of the pool
    NaN at the start, chunked prompts, prefix hits, preemption and decode steps give the same tokens
    as a zeroed pool (a kernel that read one would spread NaN into its scores or outputs)."""
    from llmd.daemon.attention import CpuAttentionBackend
    from llmd.daemon.engine import model_runner
    from llmd.daemon.quantization import QuantConfig

    case = dict(case)
    attention = CpuAttentionBackend() if case.pop("attention", None) == "cpu" else None
    quant, dtype = (QuantConfig("int4"), torch.bfloat16) if case.pop("native", False) else (None, torch.float32)
    config = dict(num_blocks=40, block_size=4, max_batched_tokens=13, **case)  # small: preemption and reuse
    requests = make_requests(10)
    real = model_runner.new_kv_cache

    def filled(value: float):
        def new_kv_cache(*args, **kwargs):
            caches = real(*args, **kwargs)
            for k, v in caches:  # every byte: 0xFF is a NaN in fp32 and bf16, -1 in int8 (a NaN scale)
                k.view(torch.uint8).fill_(value)
                v.view(torch.uint8).fill_(value)
            return caches
        return new_kv_cache

    outputs = []
    for byte in (0x00, 0xFF):
        monkeypatch.setattr(model_runner, "new_kv_cache", filled(byte))
        engine = make_engine(tiny_dir, attention=attention, quant=quant, dtype=dtype, **config)
        first = engine.runner.kv_caches[0][0]
        assert byte == 0 or (first.dtype == torch.int8 or torch.isnan(first.float()).all())
        outputs.append(run_engine(engine, requests))
        assert engine.scheduler.num_preemptions > 0 and engine.stats().prefix_cache_hit_rate > 0
    assert outputs[1] == outputs[0]


@pytest.mark.parametrize("limit", [0, 21, 10**6])
def test_prompt_tokens_take_the_native_step_by_their_position(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                              limit: int) -> None:
    """Prompt tokens at positions below llama.STEP_PROMPT_POSITIONS run as rows of the native decode
    step, the rest layer by layer after them, whatever chunk they are in: with the line at 0 (every
    prompt token layer by layer, as before), inside chunks (13-token chunks straddle position 21) and
    past every prompt, chunked prompts, prefix hits and preemption give the same greedy tokens as
    with every prompt token in the step (fp32: the two paths differ by rounding only)."""
    from llmd.daemon.attention import CpuAttentionBackend
    from llmd.daemon.models import llama
    from llmd.daemon.quantization import QuantConfig

    requests = make_requests(10)
    config = dict(num_blocks=40, block_size=4, max_batched_tokens=13)
    want = run_engine(make_engine(tiny_dir, attention=CpuAttentionBackend(), quant=QuantConfig("int4"), **config),
                      requests)
    monkeypatch.setattr(llama, "STEP_PROMPT_POSITIONS", limit)
    engine = make_engine(tiny_dir, attention=CpuAttentionBackend(), quant=QuantConfig("int4"), **config)
    assert engine.model.decode_step is not None
    layered: list[int] = []  # the positions run layer by layer
    real = engine.model._forward_layers

    def counted(x, positions, *args):
        layered.extend(positions.tolist())
        return real(x, positions, *args)

    monkeypatch.setattr(engine.model, "_forward_layers", counted)
    assert run_engine(engine, requests) == want
    assert engine.scheduler.num_preemptions > 0 and engine.stats().prefix_cache_hit_rate > 0
    assert layered and min(layered) >= limit if limit < 10**6 else not layered
