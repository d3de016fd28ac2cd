"""llmd: a local LLM inference daemon.

Importing :mod:`llmd` stays cheap (no torch) so that ``llmd --help`` answers at once; the heavy
pieces live in :mod:`llmd.daemon` and are imported where they are used.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("llmd")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
