"""Reading a Hugging Face checkpoint's safetensors files (single or sharded), validated first.

The safetensors library itself trusts the header; a truncated download would otherwise surface as
an obscure error (or a bus error on a memory map). We check every tensor's byte range against the
file size before opening it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from llmd.errors import CorruptModelError, InvalidModelError

_DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def find_safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: those named by the shard index if there is one, else all.

    Raises:
        InvalidModelError: no weight files, or the index names a shard that is not there.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptModelError(f"{index} is not a valid shard index ({e})") from None
        files = [model_dir / name for name in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise InvalidModelError(
                f"{model_dir} is missing shard(s) {', '.join(absent)} named in {index.name}; "
                "download the model again"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InvalidModelError(
            f"{model_dir} has no *.safetensors weights (llmd reads only safetensors or .gguf; .bin and .pt checkpoints are not loaded)"
        )
    return files


def validate_safetensors(path: Path) -> dict[str, dict]:
    """Parse and check one file's header; returns the tensor table.

    Raises:
        CorruptModelError: the header is unreadable or a tensor's bytes lie outside the file.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CorruptModelError(f"{path} is truncated (only {size} bytes): download it again")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise CorruptModelError(
                f"{path} is truncated or corrupt: its header claims {header_len} bytes but the file "
                f"has {size}; download it again"
            )
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise CorruptModelError(f"{path} has a corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CorruptModelError(f"{path} has a corrupt safetensors header")
    data_bytes = size - 8 - header_len
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, info in tensors.items():
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            numel = 1
            for dim in info["shape"]:
                numel *= int(dim)
            expected = numel * _DTYPE_SIZES[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise CorruptModelError(f"{path}: bad header entry for tensor {name}") from None
        if not 0 <= begin <= end or end - begin != expected:
            raise CorruptModelError(f"{path}: tensor {name} has inconsistent offsets; the file is corrupt")
        if end > data_bytes:
            raise CorruptModelError(
                f"{path} is truncated: tensor {name} ends at byte {end} of the data section but only "
                f"{data_bytes} bytes are present; download it again"
            )
    return tensors


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in ``files`` (all validated before the first)."""
    for path in files:
        validate_safetensors(path)
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
