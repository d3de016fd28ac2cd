"""The engine on the real default model: batching, chunking and preemption leave greedy output
unchanged, and a shared 1,000-token prefix is served from the cache."""

from __future__ import annotations

import inspect
import json

import pytest
from tiny_models import run_engine

from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.generate import Generator

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?", "Name three colours.", "What is 2+2?", "Who wrote Hamlet?",
    "Explain gravity in one sentence.", "What is a prime number?", "Translate 'hello' to Spanish.",
    "Give me a haiku about the sea.", "What does a CPU do?", "Why is the sky blue?",
    "List two fruits that are red.", "What is the boiling point of water in Celsius?",
    "Write a short greeting for a birthday card, please, keeping it to one line.",
    "What is photosynthesis?", "How many legs does a spider have?", "What is Python?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    from llmd import LLM

    return LLM(num_blocks=512, max_num_batched_tokens=50)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    return [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(llm, prompts) -> list[list[int]]:
    gen = Generator(llm.engine.model)
    return [list(gen.stream(p, GREEDY)) for p in prompts]


def test_sixteen_staggered_requests_match_one_at_a_time(llm, prompts, reference) -> None:
    requests = [(i // 2, f"q{i}", p, GREEDY) for i, p in enumerate(prompts)]
    got = run_engine(llm.engine, requests)
    assert [got[f"q{i}"] for i in range(len(prompts))] == reference
    assert llm.engine.stats().prefix_cache_hit_rate > 0  # the system prompt is shared


@pytest.mark.parametrize("chunk", [7, 13])
def test_chunked_prefill_matches(llm, prompts, reference, chunk: int) -> None:
    from llmd.daemon.engine.engine import LLMEngine, EngineConfig

    engine = LLMEngine(llm.engine.model, llm.tokenizer, EngineConfig(num_blocks=128, max_num_batched_tokens=chunk,
                                                                    enable_prefix_caching=False))
    got = run_engine(engine, [(0, f"q{i}", prompts[i], GREEDY) for i in (0, 12)])
    assert [got["q0"], got["q12"]] == [reference[0], reference[12]]


def test_preemption_matches(llm, prompts, reference) -> None:
    from llmd.daemon.engine.engine import LLMEngine, EngineConfig

    engine = LLMEngine(llm.engine.model, llm.tokenizer, EngineConfig(num_blocks=14, max_num_batched_tokens=64))
    picks = [0, 4, 9, 12]
    got = run_engine(engine, [(0, f"q{i}", prompts[i], GREEDY) for i in picks])
    assert engine.scheduler.num_preemptions > 0
    assert [got[f"q{i}"] for i in picks] == [reference[i] for i in picks]


def test_shared_1000_token_prefix_is_served_from_the_cache(llm) -> None:
    from llmd.daemon.engine.engine import LLMEngine, EngineConfig

    tok = llm.tokenizer
    text = "\n\n".join(inspect.getdoc(m) or "" for m in (json, inspect))
    prefix = tok.encode(text)[:1000]
    assert len(prefix) == 1000
    first = prefix + tok.encode("\nQuestion: what is this module for?\nAnswer:")
    second = prefix + tok.encode("\nQuestion: who would use this?\nAnswer:")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = LLMEngine(llm.engine.model, tok, EngineConfig(num_blocks=256, max_num_batched_tokens=512))
    run_engine(engine, [(0, "first", first, params)])
    before = engine.meter.num_prefill_total
    out = run_engine(engine, [(0, "second", second, params)])["second"]
    recomputed = engine.meter.num_prefill_total - before
    assert recomputed < 32, f"recomputed {recomputed} prompt tokens of {len(second)}"
    assert recomputed == len(second) - 1000 + 1000 % 16  # everything after the last full shared block
    uncached = LLMEngine(llm.engine.model, tok, EngineConfig(num_blocks=256, max_num_batched_tokens=512,
                                                             enable_prefix_caching=False))
    assert run_engine(uncached, [(0, "second", second, params)])["second"] == out
