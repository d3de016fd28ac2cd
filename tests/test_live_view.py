"""The engine's live view for the dashboard: every KV block's state and the request rows it refers to."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import make_engine, make_hf_model, save_hf_model

from llmd.protocol import BLOCK_CACHED, BLOCK_FIRST_OWNER, BLOCK_FREE, BLOCK_SHARED
from llmd.daemon.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(make_hf_model("qwen2"), tmp_path_factory.mktemp("live") / "m", with_tokenizer=True)


def test_block_states_follow_requests(model_dir: Path) -> None:
    engine = make_engine(model_dir, num_blocks=32, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    shared = list(range(10, 30))  # 5 full blocks
    blocks, rows = engine.live_view()
    assert blocks == bytes(32) and rows == []

    engine.add_request("a", shared + [1, 2], params)
    engine.step()  # a: prompt computed, first token sampled
    blocks, rows = engine.live_view()
    a_blocks = engine.scheduler.running[0].block_ids
    assert [r.request_id for r in rows] == ["a"] and rows[0].state == "running" and rows[0].generated_tokens == 1
    assert all(blocks[b] == BLOCK_FIRST_OWNER for b in a_blocks)
    assert blocks.count(BLOCK_FIRST_OWNER) == len(a_blocks) and blocks.count(BLOCK_FREE) == 32 - len(a_blocks)

    engine.add_request("b", shared + [3], params)  # hits a's 5 full blocks
    engine.step()
    blocks, rows = engine.live_view()
    running = {seq.request_id: seq for seq in engine.scheduler.running}
    assert [r.request_id for r in rows] == ["a", "b"]
    b_row = rows[1]
    assert b_row.cached_tokens == 20 and b_row.prompt_tokens == 21
    shared_blocks = set(running["a"].block_ids) & set(running["b"].block_ids)
    assert len(shared_blocks) == 5 and all(blocks[b] == BLOCK_SHARED for b in shared_blocks)
    assert all(blocks[b] == BLOCK_FIRST_OWNER + 1 for b in set(running["b"].block_ids) - shared_blocks)

    while engine.has_unfinished():  # finish everything
        engine.step()
    blocks, rows = engine.live_view()
    assert rows == []
    # the finished requests' full blocks stay cached for the next prefix hit; the rest are free
    assert blocks.count(BLOCK_CACHED) == engine.stats().num_blocks_cached_free > 0
    assert set(blocks) <= {BLOCK_FREE, BLOCK_CACHED}


def test_waiting_rows_and_rates(model_dir: Path) -> None:
    engine = make_engine(model_dir, num_blocks=64, block_size=4, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("first", [5] * 9, params)
    engine.add_request("second", [6] * 9, SamplingParams(max_tokens=8, response_format={"type": "json_object"}))
    for _ in range(4):
        engine.step()
    _, rows = engine.live_view()
    assert [(r.request_id, r.state) for r in rows] == [("first", "running"), ("second", "waiting")]
    first, second = rows
    assert first.generated_tokens == 4 and first.ttft is not None and first.tokens_per_s > 0
    assert second.generated_tokens == 0 and second.ttft is None and second.tokens_per_s is None
    assert (first.format, second.format) == (None, "json_object")  # the dashboard marks constrained requests
