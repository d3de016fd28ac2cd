"""How big the KV pool is: the GPU budget policy (pure arithmetic, testable without a GPU) and the
profile run that measures the activation peak (run here on the CPU)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import make_engine, make_hf_model, save_hf_model

from llmd.daemon.engine import kv_budget
from llmd.daemon.engine.engine import EngineConfig
from llmd.daemon.engine.kv_budget import GPU_MARGIN_BYTES, cpu_kv_pool, gpu_kv_budget_bytes, measure_gpu_kv_budget

GIB = 1 << 30


MIB = 1 << 20


def test_cpu_pool_by_default_reserves_whole_contexts_and_caches_one_gib(monkeypatch) -> None:
    monkeypatch.setattr(kv_budget, "available_ram_bytes", lambda: 16 * GIB)
    # a 3B's 1.75 MiB blocks (16 tokens of 28 layers x 8 KV heads x 128 x bf16 K and V): 64 sequences of
    # 8k want 32,768 blocks; a quarter of 16 GiB reserves 2,340 of them (40k tokens: the flat 1 GiB pool
    # held 9,360); the prefix cache keeps 585 (1 GiB) resident
    assert cpu_kv_pool(None, 1792 * 1024, 64 * 512) == (4 * GIB // (1792 * 1024), GIB // (1792 * 1024))
    # a small model: every whole context fits in less than a quarter of the RAM, and in the cache's 1 GiB
    assert cpu_kv_pool(None, 64 * 1024, 2 * 100) == (200, 200)
    # little RAM: the reservation and the cache share a quarter of what is available
    monkeypatch.setattr(kv_budget, "available_ram_bytes", lambda: 2 * GIB)
    assert cpu_kv_pool(None, MIB, 10_000) == (512, 512)


def test_cpu_pool_of_a_given_size_is_all_cache(monkeypatch) -> None:
    monkeypatch.setattr(kv_budget, "available_ram_bytes", lambda: 16 * GIB)
    assert cpu_kv_pool(2048, MIB, 10_000) == (2048, 2048)
    assert cpu_kv_pool(2048, MIB, 300) == (300, 300)  # more than whole contexts is never used
    assert cpu_kv_pool(1, 4 * MIB, 300) == (1, 1)  # at least a block


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
    # bit for bit: a pool is not initialised (model_runner.new_kv_cache), and its bytes may read as NaN
    assert all(k.view(torch.uint8).equal(k0.view(torch.uint8)) and v.view(torch.uint8).equal(v0.view(torch.uint8))
               for (k, v), (k0, v0) in zip(caches, before))


class FakeCuda:
    """The torch.cuda calls measure_gpu_kv_budget makes, on a made-up 8 GiB card: 2 GiB of weights,
    a 1 GiB activation peak during the profile run, 1 GiB held by another process."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.reserved = 2 * GIB + (512 << 20)  # weights, plus 512 MiB the loader left cached
        self.peak = self.reserved

    def synchronize(self, device=None) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved = 2 * GIB

    def reset_peak_memory_stats(self, device=None) -> None:
        self.calls.append("reset_peak")
        self.peak = self.reserved

    def max_memory_reserved(self, device=None) -> int:
        return self.peak

    def memory_reserved(self, device=None) -> int:
        return self.reserved

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self.calls.append("mem_get_info")
        return 8 * GIB - GIB - self.reserved, 8 * GIB

    def profile(self, num_tokens: int, num_seqs: int) -> None:
        self.calls.append(f"profile {num_tokens} {num_seqs}")
        self.reserved = self.peak = 3 * GIB


def fake_runner(cuda: FakeCuda, backend: str = "triton") -> SimpleNamespace:
    model = SimpleNamespace(attn_backend=SimpleNamespace(name=backend))
    return SimpleNamespace(device=torch.device("cuda"), model=model, profile_run=cuda.profile)


def test_measure_gpu_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda()
    monkeypatch.setattr(kv_budget.torch, "cuda", cuda)
    budget = measure_gpu_kv_budget(fake_runner(cuda), None, 512, 64, 0.8)
    # the loader's cached blocks are released before the peak is reset, so they do not count as
    # activations; the activations' blocks are released before the free memory is read
    assert cuda.calls == ["synchronize", "empty_cache", "reset_peak", "profile 512 64", "synchronize",
                          "empty_cache", "mem_get_info"]
    free = 8 * GIB - GIB - 2 * GIB
    assert budget == min(int(0.8 * 8 * GIB) - 3 * GIB, free - GIB - GPU_MARGIN_BYTES)


def test_measure_gpu_budget_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda()
    monkeypatch.setattr(kv_budget.torch, "cuda", cuda)
    assert measure_gpu_kv_budget(fake_runner(cuda), 1024, 512, 64, 0.8) == 1024 << 20  # fits: no profile run
    with pytest.raises(ValueError, match="--kv-cache-mb 8000 does not fit"):
        measure_gpu_kv_budget(fake_runner(cuda), 8000, 512, 64, 0.8)
    with pytest.raises(ValueError, match="torch attention backend cannot size the KV cache itself; give --kv-cache-mb"):
        measure_gpu_kv_budget(fake_runner(cuda, "torch"), None, 512, 64, 0.8)
    assert not any(call.startswith("profile") for call in cuda.calls)

    def out_of_memory(num_tokens: int, num_seqs: int) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    runner = fake_runner(cuda)
    runner.profile_run = out_of_memory
    with pytest.raises(ValueError, match="--max-batched-tokens 512 does not fit in GPU memory"):
        measure_gpu_kv_budget(runner, None, 512, 64, 0.8)
