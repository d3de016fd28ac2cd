"""llmd: a local LLM inference daemon.

Importing :mod:`llmd` stays cheap (no torch) so that ``llmd --help`` answers at once; the heavy
pieces live in :mod:`llmd.daemon` and are imported where they are used.
"""

from __future__ import annotations

from llmd.kernels import cpu_profile

# NOTE: before anything imports torch: LLMD_CPU=avx2|portable caps torch's own CPU dispatch too.
cpu_profile.apply_torch_env()

__all__ = ["AsyncClient", "Client", "LLM", "SamplingParams", "__version__"]

_LAZY = {
    "Client": "llmd.client",
    "AsyncClient": "llmd.client",
    "LLM": "llmd.daemon.llm",
    "SamplingParams": "llmd.daemon.engine.sampling_params",
}


def _version() -> str:
    # (importlib.metadata costs ~30 ms of every command's start and the daemon's, asked for or not)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llmd")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0.0.0+unknown"


def __getattr__(name: str) -> object:
    # NOTE: lazy, so `import llmd` (and the CLI's --help) does not pay for torch.
    if name == "__version__":
        globals()["__version__"] = found = _version()
        return found
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmd' has no attribute {name!r}")
