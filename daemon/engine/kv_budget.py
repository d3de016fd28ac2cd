"""How much memory the paged KV pool gets: the rest of the device once weights and activations fit.

CPU: ``--kv-cache-mb``; by default, what ``max_num_seqs`` sequences of the whole context need, at most
a quarter of the RAM available at start (the desktop keeps the rest). The pool is reserved, not
written (model_runner.new_kv_cache), so a large reservation costs nothing until blocks fill; by default
the prefix cache may keep 1 GiB of it resident (:func:`cpu_kv_pool`, block_pool.BlockPool), and only
sequences running at once take more.

CUDA: ``--kv-cache-mb`` if given, checked against the free memory. Otherwise, after the weights are
loaded, the model runner runs the largest step the scheduler can make
(:meth:`ModelRunner.profile_run`) to measure the activation peak; then the pool takes what is left of
``gpu_memory_fraction`` of the card, and never more than what is free right now (the desktop and other
processes hold the rest), minus a margin for allocations torch does not see (cuBLAS workspaces,
Triton's compiled kernels, fragmentation). vLLM sizes its pool the same way.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llmd.daemon.engine.model_runner import ModelRunner

DEFAULT_CPU_KV_CACHE_MB = 1024
GPU_MARGIN_BYTES = 256 << 20


def available_ram_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def cpu_kv_budget_bytes(kv_cache_mb: int | None) -> int:
    """What the prefix cache keeps resident at most (``kv_cache_mb`` if given, else 1 GiB, at most a
    quarter of the available RAM): the memory a loaded model's pool holds in ordinary use."""
    return (kv_cache_mb or min(DEFAULT_CPU_KV_CACHE_MB, available_ram_bytes() // 4 >> 20)) << 20


def cpu_kv_pool(kv_cache_mb: int | None, block_bytes: int, useful_blocks: int) -> tuple[int, int]:
    """The CPU pool as ``(blocks, resident_target)``: how many blocks it reserves, and how many of them
    the prefix cache may make resident before it evicts (block_pool.BlockPool).

    ``kv_cache_mb`` given: that much, all of it for the cache too. Default: ``useful_blocks`` (what
    max_num_seqs whole contexts fill; more is never used), at most a quarter of the available RAM; the
    cache keeps :func:`cpu_kv_budget_bytes` of it. Never fewer than one block.
    """
    if kv_cache_mb is not None:
        blocks = max(1, min((kv_cache_mb << 20) // block_bytes, useful_blocks))
        return blocks, blocks
    blocks = max(1, min(available_ram_bytes() // 4 // block_bytes, useful_blocks))
    return blocks, max(1, min(cpu_kv_budget_bytes(None) // block_bytes, blocks))


def gpu_kv_budget_bytes(total: int, free: int, peak_reserved: int, reserved: int, fraction: float) -> int:
    """Bytes for the KV pool on a GPU.

    Args:
        total, free: the device's memory and what is free now (``torch.cuda.mem_get_info``), after
            the profile run.
        peak_reserved: the most this process's allocator held during the profile run (weights plus
            the activation peak).
        reserved: what it holds now (weights, plus cached activation memory unless emptied).
        fraction: the share of ``total`` this process may use in all.

    Raises:
        ValueError: nothing is left for the pool; the message says what to change.
    """
    within_fraction = int(fraction * total) - peak_reserved
    # Activation memory beyond what the allocator still holds must come out of `free` too.
    within_free = free - (peak_reserved - reserved) - GPU_MARGIN_BYTES
    budget = min(within_fraction, within_free)
    if budget <= 0:
        mib = 1 << 20
        raise ValueError(
            f"no GPU memory left for the KV cache: weights and activations take {peak_reserved // mib} MiB, "
            f"--gpu-memory-fraction {fraction} allows {int(fraction * total) // mib} MiB of {total // mib} MiB, "
            f"{free // mib} MiB are free; raise --gpu-memory-fraction, lower --max-batched-tokens, "
            "or choose a smaller model or --quant int4")
    return budget


def measure_gpu_kv_budget(runner: ModelRunner, kv_cache_mb: int | None, max_batched_tokens: int,
                          max_num_seqs: int, fraction: float) -> int:
    """The KV pool's bytes on the runner's GPU: ``kv_cache_mb`` if given (checked against the free
    memory), else profile the largest step and return :func:`gpu_kv_budget_bytes`.

    Raises:
        ValueError: it does not fit, or cannot be sized; the message says what to change.
    """
    device = runner.device
    mib = 1 << 20
    if kv_cache_mb is not None:
        free, _ = torch.cuda.mem_get_info(device)
        if (kv_cache_mb << 20) > free - GPU_MARGIN_BYTES:
            raise ValueError(f"--kv-cache-mb {kv_cache_mb} does not fit: {free // mib} MiB of GPU memory are free "
                             f"and {GPU_MARGIN_BYTES // mib} MiB stay spare; lower it")
        return kv_cache_mb << 20
    if runner.model.attn_backend.name == "torch":
        # Its decode copies every sequence's whole context out of the cache, so its activation
        # memory grows with the context: one profiled step cannot bound it.
        raise ValueError("on a GPU the torch attention backend cannot size the KV cache itself; give "
                         "--kv-cache-mb, or install triton (pip install triton) for the Triton kernels")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # blocks the loader left cached are not activations
    torch.cuda.reset_peak_memory_stats(device)
    try:
        runner.profile_run(max_batched_tokens, max_num_seqs)
        torch.cuda.synchronize(device)
    except torch.OutOfMemoryError:
        raise ValueError(f"a step of --max-batched-tokens {max_batched_tokens} does not fit in GPU memory "
                         "next to the weights; lower --max-batched-tokens or choose --quant int4") from None
    peak = torch.cuda.max_memory_reserved(device)
    torch.cuda.empty_cache()  # hand the activations' cached blocks back; the pool may need them
    free, total = torch.cuda.mem_get_info(device)
    return gpu_kv_budget_bytes(total, free, peak, torch.cuda.memory_reserved(device), fraction)
