"""Device and dtype choices: what `--device auto` and `--dtype auto` mean on this machine."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX), where bf16 matmuls run
    3-4x faster than fp32 at batch >= 16 (measured on an AMD EPYC with avx512_bf16). Without
    those instructions bf16 is emulated and slower than fp32."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """Map ``auto|float32|bfloat16|float16`` to a torch dtype for ``device``.

    ``auto``: bf16 on CUDA GPUs that support it (else fp16); on the CPU, bf16 where the CPU
    multiplies it natively, else fp32.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]
