"""Device and dtype choices: what `--device auto` and `--dtype auto` mean on this machine."""

from __future__ import annotations

import torch

from llmd.errors import LlmdError
from llmd.kernels import cpu_profile

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> str:
    """Map ``auto|cpu|cuda`` to ``cpu`` or ``cuda``: ``auto`` is CUDA when torch sees a GPU.

    Raises:
        LlmdError: ``cuda`` without a GPU, or an unknown name.
    """
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise LlmdError("--device cuda: no CUDA device is available (this torch build or machine has none); "
                        "use --device cpu")
    if device != "cpu" and device != "cuda":
        raise LlmdError(f"--device must be auto, cpu or cuda, got {device!r}")
    return device


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """Map ``auto|float32|bfloat16|float16`` to a torch dtype for ``device``.

    ``auto``: bf16 on CUDA GPUs that compute it natively (Ampere and later), else fp16; on the CPU,
    bf16 where the CPU multiplies it natively (under the CPU profile, llmd.kernels.cpu_profile), else fp32.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        if device.startswith("cuda"):
            # including_emulation=False: pre-Ampere cards "support" bf16 only by slow emulation
            return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
        return torch.bfloat16 if cpu_profile.has_fast_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def host_tensor(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device`` without waiting for the GPU.

    ``torch.tensor(values, device="cuda")`` is a blocking copy: it waits for every kernel queued
    before it. Built on the CPU and copied with ``non_blocking``, CUDA stages the pageable source at
    once and the host goes on queueing work; the hot loop's only sync stays the sampled token ids.
    """
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
