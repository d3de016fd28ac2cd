"""A GGUF file's header and tensors, parsed straight from a memory map.

Why not ``gguf.GGUFReader``: it builds a numpy view for every element of every metadata array, and a
vocabulary is three arrays of 50k-150k entries (tokens, scores, merges), so it spends seconds holding
the GIL before the first tensor (3.6 s on SmolLM2's 49k vocabulary, 2 cores). That is most of a
daemon's start, and a pause of every model another model's load runs beside. Here a scalar is one
``struct`` read, a numeric array one ``np.frombuffer`` view, and a string array is stepped over and
decoded only if asked for (the model's config needs its length, the tokenizer build reads it with
transformers, once).

Every read is bounded by the file: a short or garbled file raises :class:`GGUFFormatError` (a
``ValueError``) with what is wrong, never an IndexError from deep inside, and never allocates what a
count in the header claims before checking the file holds it.

The format (github.com/ggml-org/ggml docs/gguf.md, version 2 and 3): magic, version, tensor count, KV
count; the KV pairs (key string, value type, value); the tensor infos (name, dims fastest first, type,
offset from the data section); the data section, aligned to ``general.alignment`` (32 by default).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUF metadata value types -> struct format of a scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

# ggml tensor types: id -> (name, elements per block, bytes per block), as ggml.h numbers them. All are
# named, so a file of a type llmd cannot read is refused by name; the loader's type check decides.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
# plain element types, read as numpy arrays of that type (BF16 has none: it is read as bytes)
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader can read, or it is cut short or garbled."""


class StringArray(Sequence[str]):
    """A metadata array of strings, decoded on access: where each string starts, nothing else."""

    def __init__(self, buf: memoryview, starts: list[int]) -> None:
        self._buf, self._starts = buf, starts

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        start = self._starts[i]
        (n,) = struct.unpack_from("<Q", self._buf, start)
        return bytes(self._buf[start + 8:start + 8 + n]).decode("utf-8", errors="replace")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor's header entry. ``shape`` is numpy's order (slowest dim first), ``offset`` from the
    start of the file."""

    name: str
    type_id: int
    shape: tuple[int, ...]
    offset: int
    n_bytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id][0] if self.type_id in GGML_TYPES else f"type {self.type_id}"

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class GGUFReader:
    """The header of the GGUF file at ``path``, and its tensors as read-only views of the file.

    Raises:
        OSError: the file cannot be opened.
        GGUFFormatError: it is not GGUF (version 2 or 3, little-endian), or is cut short or garbled.
    """

    def __init__(self, path: str | Path) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 (read() reads through it while the reader lives)
        size = self._file.seek(0, 2)
        if size < 24:
            self._file.close()
            raise GGUFFormatError(f"the file has {size} bytes, fewer than a GGUF header")
        self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._mmap)
        self.size = size
        self.fields: dict[str, Any] = {}
        self.tensors: list[TensorInfo] = []
        self._parse()

    # -- reading, bounded by the file
    def _need(self, pos: int, n: int, what: str) -> None:
        if n < 0 or pos + n > self.size:
            raise GGUFFormatError(f"the file ends inside {what} (byte {pos} + {n} of {self.size})")

    def _unpack(self, fmt: str, pos: int, what: str) -> tuple[Any, int]:
        n = struct.calcsize("<" + fmt)
        self._need(pos, n, what)
        return struct.unpack_from("<" + fmt, self._buf, pos)[0], pos + n

    def _string(self, pos: int, what: str) -> tuple[str, int]:
        n, pos = self._unpack("Q", pos, what)
        self._need(pos, n, what)
        try:
            return str(self._buf[pos:pos + n], "utf-8"), pos + n
        except UnicodeDecodeError:
            raise GGUFFormatError(f"{what} is not UTF-8 (byte {pos})") from None

    def _value(self, type_id: int, pos: int, what: str) -> tuple[Any, int]:
        if type_id in _SCALARS:
            return self._unpack(_SCALARS[type_id], pos, what)
        if type_id == _STRING:
            return self._string(pos, what)
        if type_id != _ARRAY:
            raise GGUFFormatError(f"{what} has an unknown value type {type_id}")
        item_type, pos = self._unpack("I", pos, what)
        count, pos = self._unpack("Q", pos, what)
        if item_type in _NUMPY:
            itemsize = np.dtype(_NUMPY[item_type]).itemsize
            self._need(pos, count * itemsize, what)
            return np.frombuffer(self._buf, _NUMPY[item_type], count, pos), pos + count * itemsize
        if item_type == _STRING:
            self._need(pos, count * 8, what)  # each string takes at least its length's 8 bytes
            starts = []
            unpack, buf, size = struct.Struct("<Q").unpack_from, self._buf, self.size
            for _ in range(count):
                starts.append(pos)
                pos += 8 + unpack(buf, pos)[0]
                if pos > size or (len(starts) < count and pos + 8 > size):
                    raise GGUFFormatError(f"the file ends inside {what} (string {len(starts)} of {count})")
            return StringArray(buf, starts), pos
        # arrays of arrays: no llama-family file has one, and nothing here would read it
        raise GGUFFormatError(f"{what} is an array of type {item_type}, which llmd does not read")

    # -- the layout
    def _parse(self) -> None:
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise GGUFFormatError("the file does not start with the GGUF magic")
        version, pos = self._unpack("I", 4, "the version")
        if version & 0xFFFF == 0:
            raise GGUFFormatError("the file is a big-endian GGUF; llmd reads little-endian ones")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, pos = self._unpack("Q", pos, "the tensor count")
        n_kv, pos = self._unpack("Q", pos, "the metadata count")
        # every KV pair and tensor info takes well over 8 bytes: a count the file cannot hold is garbage
        if (n_tensors + n_kv) * 8 > self.size:
            raise GGUFFormatError(f"the header claims {n_tensors} tensors and {n_kv} metadata keys, more "
                                  "than the file can hold")
        for i in range(n_kv):
            key, pos = self._string(pos, f"metadata key {i}")
            type_id, pos = self._unpack("I", pos, f"metadata {key}")
            self.fields[key], pos = self._value(type_id, pos, f"metadata {key}")
        infos = []
        for i in range(n_tensors):
            name, pos = self._string(pos, f"tensor info {i}")
            n_dims, pos = self._unpack("I", pos, f"tensor {name}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFFormatError(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS})")
            self._need(pos, 8 * n_dims, f"tensor {name}")
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, pos)
            pos += 8 * n_dims
            type_id, pos = self._unpack("I", pos, f"tensor {name}")
            offset, pos = self._unpack("Q", pos, f"tensor {name}")
            infos.append((name, dims, type_id, offset))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment must be a power of two, got {alignment!r}")
        self.alignment = alignment
        self.data_offset = -(-pos // alignment) * alignment
        names: set[str] = set()
        for name, dims, type_id, offset in infos:
            if name in names:
                raise GGUFFormatError(f"tensor {name} is listed twice")
            names.add(name)
            shape = tuple(int(d) for d in reversed(dims))
            n_elements = 1
            for d in shape:
                n_elements *= d
            _, block, block_bytes = GGML_TYPES.get(type_id, ("", 1, 0))
            if n_elements % block or shape[-1] % block:
                raise GGUFFormatError(f"tensor {name}'s rows ({shape[-1]}) are not whole blocks of {block}")
            start = self.data_offset + offset
            n_bytes = n_elements // block * block_bytes
            self._need(start, n_bytes, f"tensor {name}'s data")
            self.tensors.append(TensorInfo(name, type_id, shape, start, n_bytes))

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value: a Python scalar or string, a numpy array, or a :class:`StringArray`."""
        return self.fields.get(key, default)

    def data(self, t: TensorInfo) -> np.ndarray:
        """``t``'s data, a read-only view of the file: of its element type, shaped like the tensor,
        for plain types; else bytes shaped ``[..., row bytes]`` (what ``gguf.quants`` dequantises)."""
        if t.type_id not in GGML_TYPES:
            raise GGUFFormatError(f"tensor {t.name} has type {t.type_id}, which llmd does not read")
        name, block, block_bytes = GGML_TYPES[t.type_id]
        if name in _PLAIN:
            return np.frombuffer(self._buf, _PLAIN[name], t.n_elements, t.offset).reshape(t.shape)
        arr = np.frombuffer(self._buf, np.uint8, t.n_bytes, t.offset)
        return arr.reshape(*t.shape[:-1], t.shape[-1] // block * block_bytes)

    def read(self, t: TensorInfo) -> np.ndarray:
        """``t``'s data as :meth:`data` shapes it, read into this process's memory (writable): a
        tensor that is converted anyway is read with a few system calls, where faulting the map in
        page by page costs ~1 s a GB."""
        view = self.data(t)
        out = np.empty(view.shape, view.dtype)
        buf, done = memoryview(out).cast("B"), 0
        while done < t.n_bytes:
            n = os.preadv(self._file.fileno(), [buf[done:]], t.offset + done)
            if n <= 0:
                raise GGUFFormatError(f"the file ends inside tensor {t.name}'s data (it shrank while read)")
            done += n
        return out

    def release(self, t: TensorInfo) -> None:
        """Drop ``t``'s pages from this process (they stay in the page cache; a later read maps them
        again): once a tensor is converted, its bytes need not count in the daemon's RSS while the
        rest loads."""
        page = mmap.PAGESIZE
        start = t.offset // page * page
        self._mmap.madvise(mmap.MADV_DONTNEED, start, t.offset + t.n_bytes - start)

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors)
