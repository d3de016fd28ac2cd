"""How big the KV pool is: the GPU budget policy (pure arithmetic, testable without a GPU) and the
profile run that measures the activation peak (run here on the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import make_engine, make_hf_model, save_hf_model

from llmd.daemon.engine.engine import EngineConfig
from llmd.daemon.engine.kv_budget import GPU_MARGIN_BYTES, gpu_kv_budget_bytes

GIB = 1 << 30


def test_gpu_budget_within_fraction() -> None:
    # 24 GiB card, nothing else running: 0.8 * 24 - 3 GiB (weights + activation peak) for the pool
    assert gpu_kv_budget_bytes(24 * GIB, 21 * GIB, 3 * GIB, 3 * GIB, 0.8) == int(0.8 * 24 * GIB) - 3 * GIB


def test_gpu_budget_within_free_memory() -> None:
    # the desktop holds 8 GiB: only what is free now, less the margin, whatever the fraction allows
    free = 24 * GIB - 8 * GIB - 3 * GIB
    assert gpu_kv_budget_bytes(24 * GIB, free, 3 * GIB, 3 * GIB, 0.8) == free - GPU_MARGIN_BYTES


def test_gpu_budget_counts_released_activations() -> None:
    # after empty_cache the allocator holds only the 2 GiB of weights; the 1 GiB activation peak
    # must still fit beside the pool, out of the free memory
    free = 8 * GIB - 2 * GIB
    assert gpu_kv_budget_bytes(8 * GIB, free, 3 * GIB, 2 * GIB, 1.0) == free - GIB - GPU_MARGIN_BYTES


def test_gpu_budget_exhausted_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache.*--gpu-memory-fraction"):
        gpu_kv_budget_bytes(8 * GIB, 5 * GIB, 7 * GIB, 7 * GIB, 0.8)


@pytest.mark.parametrize("fraction", [0, 1.5, -0.1, True, "0.5"])
def test_gpu_memory_fraction_validated(fraction: object) -> None:
    with pytest.raises(ValueError, match="gpu_memory_fraction"):
        EngineConfig(gpu_memory_fraction=fraction)


def test_profile_run_leaves_no_trace(tmp_path: Path) -> None:
    engine = make_engine(save_hf_model(make_hf_model("qwen2"), tmp_path / "m", with_tokenizer=True), num_blocks=8)
    caches = engine.runner.kv_caches
    before = [(k.clone(), v.clone()) for k, v in caches]
    engine.runner.profile_run(num_tokens=100, num_seqs=4)  # more tokens than the 8-block pool holds
    assert engine.runner.kv_caches is caches
    assert all(k.equal(k0) and v.equal(v0) for (k, v), (k0, v0) in zip(caches, before))
    assert engine.kv.usage.num_used == 0 and not engine.requests
