"""Host-side arithmetic for Triton launches (grids, block sizes), in plain Python.

NOTE: ``triton.cdiv`` and ``triton.next_power_of_2`` are ``ConstexprFunction`` objects in Triton 3.x,
usable inside kernels and costing a few microseconds per call from the host; a decode step sizes
hundreds of launches, so the wrappers use these instead (benchmarks/decode_launches.py).
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
