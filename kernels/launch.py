"""Host-side helpers for Triton launches: grid arithmetic in plain Python, and the scratch buffers
that split-K kernels share.

NOTE: ``triton.cdiv`` and ``triton.next_power_of_2`` are ``ConstexprFunction`` objects in Triton 3.x,
usable inside kernels and costing a few microseconds per call from the host; a decode step sizes
hundreds of launches, so the wrappers use these instead (benchmarks/decode_launches.py).
"""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# Scratch shared by every kernel launched on a device. Launches on one stream run in order, and each
# kernel that uses these leaves its arrival counters at zero, so one buffer serves them all. Grown,
# never shrunk; a buffer grown out of is kept, not freed, because a captured CUDA graph may still
# point at it (a bucket captured before a larger one needed more).
_counters: dict[torch.device, torch.Tensor] = {}
_workspaces: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 counters, zero between launches: split-K programs count their arrivals
    in them, and the last to arrive combines the splits and resets its counter."""
    held = _counters.get(device)
    if held is None or held.numel() < n:
        if held is not None:
            _retired.append(held)
        held = _counters[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return held


def workspace(device: torch.device, numel: int) -> torch.Tensor:
    """At least ``numel`` fp32 of scratch for split-K partial results; its contents never outlive a
    launch."""
    held = _workspaces.get(device)
    if held is None or held.numel() < numel:
        if held is not None:
            _retired.append(held)
        held = _workspaces[device] = torch.empty(max(numel, 1 << 16), dtype=torch.float32, device=device)
    return held
