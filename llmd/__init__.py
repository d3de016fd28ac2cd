"""llmd: a local LLM inference daemon.

Importing :mod:`llmd` stays cheap (no torch) so that ``llmd --help`` answers at once; the heavy
pieces live in :mod:`llmd.daemon` and are imported where they are used.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from llmd.kernels import cpu_profile

# NOTE: before anything imports torch: LLMD_CPU=avx2|portable caps torch's own CPU dispatch too.
cpu_profile.apply_torch_env()

try:
    __version__ = version("llmd")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["AsyncClient", "Client", "LLM", "SamplingParams", "__version__"]

_LAZY = {
    "Client": "llmd.client",
    "AsyncClient": "llmd.client",
    "LLM": "llmd.daemon.llm",
    "SamplingParams": "llmd.daemon.engine.sampling_params",
}


def __getattr__(name: str) -> object:
    # NOTE: lazy, so `import llmd` (and the CLI's --help) does not pay for torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmd' has no attribute {name!r}")
