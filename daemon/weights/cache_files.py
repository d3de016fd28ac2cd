"""The prepared-weights cache's files (daemon/weights/prepared_cache.py writes and maps them): where
they live, their header, and which of them nothing will map again. Without torch, so that ``llmd rm``
frees a removed model's file at once.

A file: an 8-byte magic, a little-endian u64 header length, a JSON header (its key, the source's
resolved path, the settings in words, the tensors), then the tensors' bytes from the first page
boundary after the header.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any

from llmd import paths

MAGIC = b"LLMDPW\x00\x01"  # the last byte is the file format's version
SUFFIX = ".llmdw"
_MAX_HEADER = 64 << 20


def cache_dir() -> Path:
    return paths.cache_home() / "weights"


def cache_path(key: str) -> Path:
    return cache_dir() / f"{key}{SUFFIX}"


def data_start(header_len: int) -> int:
    """Where a file's tensors begin, for a header of ``header_len`` bytes: the next page boundary."""
    end = len(MAGIC) + 8 + header_len
    return end + -end % mmap.PAGESIZE


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The header of the cache file at ``path`` and where its data starts.

    Raises:
        ValueError: not a cache file of this format.
        OSError: it cannot be read.
    """
    with open(path, "rb") as f:
        start = f.read(len(MAGIC) + 8)
        if len(start) < len(MAGIC) + 8 or start[:len(MAGIC)] != MAGIC:
            raise ValueError("not an llmd weights cache of this version")
        (n,) = struct.unpack("<Q", start[len(MAGIC):])
        if n > _MAX_HEADER:
            raise ValueError(f"a header of {n} bytes")
        raw = f.read(n)
    if len(raw) != n:
        raise ValueError("the file ends inside its header")
    try:
        header = json.loads(raw)
    except RecursionError:  # nested too deep for the parser
        raise ValueError("a header nested too deep") from None
    if not isinstance(header, dict) or not all(isinstance(header.get(k), str) for k in ("key", "source", "settings")):
        raise ValueError("a header without its key, source or settings")
    if not isinstance(header.get("packed"), dict) or not isinstance(header.get("tensors"), dict):
        raise ValueError("a header without its tensors")
    return header, data_start(n)


def sweep(kept: Path | None = None, source: str | None = None, settings: str | None = None) -> int:
    """Remove the cache files nothing will map again: those of models whose file is gone, files not
    readable as this format's, the temp files of writers that died, and with ``kept`` (a file just
    written) the files it replaces: the same ``source`` with the same ``settings``. Returns the bytes
    freed. (A daemon mapping a removed file keeps its pages until it unloads: unlinking is safe.)"""
    directory = cache_dir() if kept is None else kept.parent
    freed = 0
    try:
        files = list(directory.iterdir())
    except FileNotFoundError:
        return 0
    for f in files:
        if f == kept:
            continue
        if f.name.endswith(".tmp"):
            pid = f.name.rsplit(".", 2)[-2]
            stale = pid.isdigit() and not Path(f"/proc/{pid}").exists()
        elif f.suffix != SUFFIX:
            continue
        else:
            try:
                header = read_header(f)[0]
                stale = (header["source"] == source and header["settings"] == settings) \
                    or not Path(header["source"]).exists()
            except (OSError, ValueError):
                stale = True  # not readable as a cache file: nothing maps it
        if stale:
            freed += _unlink(f)
    return freed


def _unlink(path: Path) -> int:
    try:
        size = path.stat().st_size
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return size
