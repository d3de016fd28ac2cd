"""Which CPU instructions llmd may use: the machine's, or fewer when ``LLMD_CPU`` says so.

``LLMD_CPU=native`` (the default) uses what the CPU has. ``avx2`` behaves as an AVX2 + FMA CPU
without AVX-512 (most desktops and laptops: AMD Zen 2/3, Intel Core 12th-14th gen) and
``portable`` as a bare x86-64 one, so that on a machine with more the other paths can be run,
tested and timed. The profile steers every CPU decision in one place:

- the flags feature detection reports (:func:`has`), hence ``--dtype auto`` and the choice of
  kernels;
- the native library's compiler flags (:func:`march_flags`: ``-march=native``,
  ``-march=x86-64-v3`` or the compiler's baseline);
- torch's own kernels (:func:`apply_torch_env`: ``ATEN_CPU_CAPABILITY``, oneDNN's and MKL's ISA
  caps), set before torch picks its kernels; explicit settings of those variables win.

No torch import here: :mod:`llmd` applies the profile before anything loads torch.
"""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

from llmd.errors import LlmdError

PROFILES = ("native", "avx2", "portable")
ENV = "LLMD_CPU"

# What an AVX2 CPU of the profile has (x86-64-v3, what -march=x86-64-v3 compiles for).
_AVX2_FLAGS = frozenset({"sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2",
                         "movbe", "popcnt", "abm"})
_PORTABLE_FLAGS = frozenset({"sse", "sse2"})

# torch, oneDNN and MKL each detect the CPU themselves; these cap them to the profile.
_TORCH_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


class CpuProfileError(LlmdError):
    """``LLMD_CPU`` names no profile."""


def profile() -> str:
    """The profile ``LLMD_CPU`` names (``native`` when unset).

    Raises:
        CpuProfileError: an unknown name.
    """
    name = os.environ.get(ENV, "").strip().lower() or "native"
    if name not in PROFILES:
        raise CpuProfileError(f"{ENV} must be one of {', '.join(PROFILES)}, got {os.environ[ENV]!r}")
    return name


@cache
def machine_flags() -> frozenset[str]:
    """The CPU's own feature flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def flags() -> frozenset[str]:
    """The feature flags llmd may use under the current profile."""
    machine = machine_flags()
    name = profile()
    if name == "avx2":
        return machine & _AVX2_FLAGS
    if name == "portable":
        return machine & _PORTABLE_FLAGS
    return machine


def has(flag: str) -> bool:
    """Whether code may use the instruction set ``flag`` (a /proc/cpuinfo name, e.g. ``avx512_bf16``)."""
    return flag in flags()


def has_fast_bf16() -> bool:
    """True where the CPU multiplies bf16 natively (AVX512-BF16 or AMX): there bf16 matmuls run
    3-4x faster than fp32 at batch >= 16 (measured on an AMD EPYC with avx512_bf16); elsewhere bf16
    is emulated and slower than fp32."""
    return has("avx512_bf16") or has("amx_bf16")


def march_flags() -> tuple[str, ...]:
    """The C compiler's target flags for the native library under this profile."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ("-mcpu=native",) if profile() == "native" else ()
    return {"native": ("-march=native",), "avx2": ("-march=x86-64-v3",), "portable": ()}[profile()]


def describe() -> str:
    """One line for logs and reports: the profile and the vector extensions it allows."""
    present = [f for f in ("avx512_bf16", "avx512_vnni", "avx512f", "avx2", "fma") if has(f)]
    return f"{profile()} ({' '.join(present) or 'no SIMD beyond SSE2'})"


def machine_line() -> str:
    """The CPU behind a benchmark's figures, on one line: model, cores, its vector flags (AVX2,
    FMA, AVX-512) and the profile in use."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    vector = sorted(f for f in machine_flags() if f.startswith("avx512") or f in ("avx2", "fma"))
    return f"CPU: {model}, {os.cpu_count()} cores, flags {' '.join(vector)}; llmd profile {describe()}"


def apply_torch_env() -> None:
    """Cap torch's, oneDNN's and MKL's CPU dispatch to the profile (no-op for ``native``). Must
    run before torch runs its first CPU kernel; variables the user set are left alone. An invalid
    ``LLMD_CPU`` is left for :func:`profile` to report where the caller can print it."""
    try:
        name = profile()
    except CpuProfileError:
        return
    for key, value in _TORCH_ENV.get(name, {}).items():
        os.environ.setdefault(key, value)
