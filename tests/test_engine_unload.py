"""LLMEngine.unload() / load(): the idle unload's engine half. The model and KV cache go, the
bookkeeping stays, the prefix cache is forgotten (its K/V are gone), and a reloaded model gives
the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import make_engine, make_hf_model, run_engine, save_hf_model

from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.loader import load_model
from llmd.daemon.model_source import resolve_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = list(range(3, 40))  # two full blocks of 16: cached after the first run


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("unload") / "m", with_tokenizer=True)


def test_unload_then_load_gives_the_same_tokens(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, num_blocks=12)
    before = run_engine(engine, [(0, "a", PROMPT, GREEDY)])["a"]
    assert engine.kv.pool.cached  # the prompt's full blocks are in the prefix cache
    engine.unload()
    assert not engine.is_loaded and engine.model is None and engine.runner is None
    assert not engine.kv.pool.cached and engine.kv.usage.num_cached_free == 0
    assert all(b.block_hash is None for b in engine.kv.pool.blocks)
    engine.add_request("queued", PROMPT, GREEDY)  # requests may queue while unloaded ...
    with pytest.raises(RuntimeError, match="unloaded"):
        engine.step()  # ... but nothing runs
    assert engine.abort_request("queued").finish_reason == "abort"  # and a queued one can be cancelled
    engine.load(load_model(resolve_model(tiny_dir)).model)
    after = run_engine(engine, [(0, "b", PROMPT, GREEDY)])["b"]
    assert after == before
    assert engine.stats().num_prompt_tokens_total == 2 * len(PROMPT)  # no hit on the forgotten prefix


def test_unload_refuses_requests_in_flight_and_foreign_models(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, num_blocks=12)
    engine.add_request("a", PROMPT, GREEDY)
    engine.step()
    with pytest.raises(RuntimeError, match="in flight"):
        engine.unload()
    assert engine.is_loaded
    while engine.has_unfinished():
        engine.step()
    engine.unload()
    other = save_hf_model(make_hf_model("llama", num_hidden_layers=3), tiny_dir.parent / "other")
    with pytest.raises(ValueError, match="differs"):
        engine.load(load_model(resolve_model(other)).model)
