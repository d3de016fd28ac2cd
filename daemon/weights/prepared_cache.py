"""The prepared-weights cache: a model's weights as the kernels hold them, written once, mapped after.

A load converts every quantised projection into the native kernels' layout: GGUF Q4 blocks
interleaved eight rows at a time, Q8_0 blocks compacted, fp16 scales gathered, a float checkpoint
fitted to INT4 with calibration. That is the same work at every start and every reload after an
idle unload: ~0.2 s for the default model, ~1 s for a 1B GGUF, minutes for a 1B float checkpoint.

After a load that ends with every projection (and the INT8 head, if any) on the native kernels,
:func:`save` writes what the model then holds to ``$XDG_CACHE_HOME/llmd/weights/<key>.llmdw``. The
next load with the same key maps that file (:func:`load`): nothing is read or converted, pages come
in as the first steps touch them (at page-cache speed once the file is warm), they are the page
cache's rather than copies, and they go with the model at an idle unload.

The key covers everything the bytes depend on: the source's files (real path, size, mtime and
inode; a changed or replaced file is a new key; hashing the content instead would read the whole
file at every start), ``--quant`` and ``--group-size``, the dtype, torch's version, and llmd's own
source files that convert weights (:data:`LAYOUT_SOURCES`), so changed conversion code never maps
an old layout. Writing a key removes the files it replaces (same model and settings) and those of
models that are gone.

The file (not safetensors: that format allows no gaps between tensors, so no alignment): an 8-byte
magic, a little-endian u64 header length, a JSON header, then each tensor's bytes at a 64-byte
aligned offset from the first page boundary after the header (daemon/weights/cache_files.py: the
directory, the header, the sweep of files nothing will map again; without torch, for ``llmd rm``,
which sweeps a removed model's file at once). A file is read as untrusted: every
field is checked, every tensor must lie inside the file and have the shape the model's config
implies, before anything is bound; anything else is a miss (logged), and the load converts the file
as if there were no cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmd.daemon.model_source import ModelSource
from llmd.daemon.weights.cache_files import MAGIC, cache_dir, cache_path, data_start, read_header, sweep
from llmd.kernels import quant_cpu
from llmd.quant.common import QuantizedLinear
from llmd.quant.int4 import Int4Linear
from llmd.quant.int8 import Int8Linear

log = logging.getLogger("llmd")

ALIGN = 64  # a cache line: no row of the kernels' layout straddles two more than it must
_DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float32": torch.float32}
_NAMES = {v: k for k, v in _DTYPES.items()}
HEAD = "head_q8"  # the INT8 head's entry (LlamaForCausalLM.head_q8)
# Free disk space a write leaves at least, beside the file itself.
_MIN_FREE_BYTES = 1 << 30
# llmd's files whose code decides the cached bytes (relative to the package root).
LAYOUT_SOURCES = ("quant", "kernels/quant_cpu.py", "kernels/int_layout.py", "kernels/cpu/repack.c",
                  "daemon/weights", "daemon/quantization.py", "daemon/loader.py", "daemon/calibration.py",
                  "daemon/calibration_text.py", "daemon/models")


@functools.cache
def layout_fingerprint() -> str:
    """A hash of :data:`LAYOUT_SOURCES` as installed (a few ms, once per process)."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for rel in LAYOUT_SOURCES:
        path = root / rel
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        for f in files:
            if f.suffix in (".py", ".c", ".h") and f.is_file():
                h.update(f"{f.relative_to(root)}\0".encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _source_files(source: ModelSource) -> list[Path]:
    real = source.path.resolve()
    return [real] if source.kind == "gguf" else sorted(p for p in real.iterdir() if p.is_file())


def cache_key(source: ModelSource, scheme: str, group_size: int | None, dtype: torch.dtype) -> str:
    """The key of ``source`` loaded with these settings by this llmd (see the module).

    Raises:
        OSError: the source cannot be listed or stat-ed.
    """
    parts = [MAGIC.hex(), layout_fingerprint(), f"torch {torch.__version__}", f"{scheme} {group_size}",
             str(dtype), str(source.path.resolve())]
    for f in _source_files(source):  # (stat follows the HF cache's links to their blobs)
        st = f.stat()
        parts.append(f"{f.name} {st.st_size} {st.st_mtime_ns} {st.st_ino}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


# -- what a prepared model holds


def _native_modules(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (Int4Linear, Int8Linear))}


def cacheable(model: nn.Module) -> str | None:
    """Why ``model`` (loaded and prepared) cannot be cached, or None: the cache holds models whose
    projections are all on the native kernels (the layout it maps is theirs)."""
    modules = _native_modules(model)
    if not modules:
        return "no projection is quantised"
    if any(m.native is None for m in modules.values()):
        return "not every projection is on the native kernels"
    if any(hasattr(m, "quant_scheme") for m in model.modules()):
        return "bitsandbytes modules"
    head = getattr(model, "head_q8", None)
    if head is not None and not isinstance(head.matmul, quant_cpu.PackedWeight):
        return "its head is not on the native kernels"
    if any(p.device.type != "cpu" or p.dtype not in _NAMES for p in model.parameters()):
        return "a weight is not on the CPU, or of a dtype the cache does not hold"
    return None


def _packed(name: str, pw: quant_cpu.PackedWeight) -> Iterator[tuple[str, torch.Tensor]]:
    yield f"{name}#w", pw.w
    yield f"{name}#scales", pw.scales
    if pw.mins is not None:
        yield f"{name}#mins", pw.mins


def _entries(model: nn.Module) -> tuple[dict[str, list[int]], list[tuple[str, torch.Tensor]]]:
    """What :func:`save` writes: the packed weights' shapes ``{module: [kind, n, k, group]}`` and
    every tensor, by name (parameters by theirs, packed weights as ``module#w`` etc.)."""
    packed: dict[str, list[int]] = {}
    tensors = list(model.named_parameters())
    natives = [(name, m.native) for name, m in _native_modules(model).items()]
    if model.head_q8 is not None:
        natives.append((HEAD, model.head_q8.matmul))
    for name, pw in natives:
        packed[name] = [pw.kind, pw.n, pw.k, pw.group_size]
        tensors.extend(_packed(name, pw))
    return packed, tensors


# -- writing


def save(model: nn.Module, key: str, source: ModelSource, settings: str) -> Path | None:
    """Write ``model``'s prepared weights under ``key`` (see the module); None, with a log line, when
    the model is not :func:`cacheable` or the disk is short. ``settings``: the settings in words, for
    the replaced-files rule and the log.

    Raises:
        OSError: the directory or the file cannot be written.
    """
    if reason := cacheable(model):
        log.info("weights not cached: %s", reason)
        return None
    packed, tensors = _entries(model)
    layout: dict[str, list[Any]] = {}
    offset = 0
    for name, t in tensors:
        offset += -offset % ALIGN
        layout[name] = [_NAMES[t.dtype], list(t.shape), offset]
        offset += t.numel() * t.element_size()
    header = json.dumps({"key": key, "source": str(source.path.resolve()), "settings": settings,
                         "packed": packed, "tensors": layout}).encode()
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    if shutil.disk_usage(directory).free < offset + _MIN_FREE_BYTES:
        log.info("weights not cached: %s has less than %d MiB free", directory, (offset + _MIN_FREE_BYTES) >> 20)
        return None
    path = cache_path(key)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # (cache_files.sweep removes a dead writer's)
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            base = data_start(len(header))
            for name, t in tensors:
                f.seek(base + layout[name][2])
                if t.numel():
                    f.write(memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy()))
            f.truncate(base + offset)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    sweep(path, str(source.path.resolve()), settings)
    return path


# -- reading


@dataclass(slots=True)
class _Mapped:
    """A cache file's tensors, checked against the file, as views of one private mapping."""

    tensors: dict[str, torch.Tensor]
    packed: dict[str, list[int]]


def _map(path: Path, key: str) -> _Mapped:
    """Raises ValueError (any defect) or OSError."""
    header, base = read_header(path)
    if header["key"] != key:
        raise ValueError("a file of another key")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        # private and writable: torch wants a writable buffer; nothing writes weights, and a write
        # would stay in this process, never reaching the file
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    tensors = {}
    for name, entry in header["tensors"].items():
        if not (isinstance(entry, list) and len(entry) == 3 and entry[0] in _DTYPES and isinstance(entry[1], list)
                and all(type(d) is int and d >= 0 for d in entry[1]) and type(entry[2]) is int and entry[2] >= 0):
            raise ValueError(f"a malformed entry for {name}")
        dtype, shape, offset = _DTYPES[entry[0]], entry[1], base + entry[2]
        count = 1
        for d in shape:
            count *= d
        nbytes = count * dtype.itemsize
        if offset % ALIGN or offset + nbytes > size:
            raise ValueError(f"{name} lies outside the file")
        if nbytes == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)
    packed = header["packed"]
    if not all(isinstance(v, list) and len(v) == 4 and all(type(x) is int for x in v) for v in packed.values()):
        raise ValueError("a malformed packed weight")
    mm.madvise(mmap.MADV_WILLNEED)  # read ahead what a cold file lacks, while the model is built
    return _Mapped(tensors, packed)


def _packed_weight(mapped: _Mapped, name: str, kind: int, n: int, k: int, group_size: int
                   ) -> quant_cpu.PackedWeight:
    """The packed weight ``name`` of ``mapped``, checked to be what the model expects: its
    kind, shape and group, and tensors of the native layout's shapes (the kernels read by them)."""
    entry = mapped.packed.get(name)
    if entry != [kind, n, k, group_size]:
        raise ValueError(f"{name} is {entry}, the model wants {[kind, n, k, group_size]}")
    t = mapped.tensors
    groups, blocks = -(-n // 8), k // quant_cpu.QK
    want = {"w": ((groups, blocks, 128 if kind == quant_cpu.Q4X8 else 256), torch.uint8),
            "scales": ((groups, k // group_size, 8), torch.float16)}
    if kind == quant_cpu.Q4X8 and f"{name}#mins" in mapped.tensors:  # (none: symmetric, GGUF Q4_0)
        want["mins"] = want["scales"]
    for part, (shape, dtype) in want.items():
        got = t.get(f"{name}#{part}")
        if got is None or tuple(got.shape) != shape or got.dtype != dtype:
            raise ValueError(f"{name}#{part} is not {dtype} {shape}")
    return quant_cpu.PackedWeight(kind, n, k, group_size, t[f"{name}#w"], t[f"{name}#scales"],
                                  t.get(f"{name}#mins"))


def load(model: nn.Module, path: Path, key: str) -> bool:
    """Bind ``model`` (built, never loaded: its projections the planned INT4/INT8 modules) to the
    cache file at ``path``: its parameters, projections and head become views of the file, then its
    decode step is prepared. False, with ``model`` untouched and a log line, when the file is
    missing, of another key, or anything in it disagrees with the model (see the module)."""
    if not path.is_file():
        return False
    try:
        bound = _bindings(model, _map(path, key))
    except (OSError, ValueError) as e:
        log.warning("not using the weights cache %s: %s", path, e)
        return False
    params, natives, head = bound
    for param, tensor in params:
        param.data = tensor
    for module, pw in natives:
        module.bind_native(pw)
    model.bind_head(head)
    model.prepare_decode()
    return True


def _bindings(model: nn.Module, mapped: _Mapped) -> tuple[list[tuple[nn.Parameter, torch.Tensor]],
                                                          list[tuple[QuantizedLinear, quant_cpu.PackedWeight]],
                                                          quant_cpu.PackedWeight | None]:
    """What :func:`load` binds, every piece checked first (ValueError on any disagreement)."""
    modules = _native_modules(model)
    head_entry = mapped.packed.get(HEAD)
    if set(mapped.packed) - {HEAD} != set(modules):
        raise ValueError("its projections are not the model's")
    natives = []
    for name, m in modules.items():
        kind = quant_cpu.Q4X8 if isinstance(m, Int4Linear) else quant_cpu.Q8X8
        natives.append((m, _packed_weight(mapped, name, kind, m.out_features, m.in_features, m.group_size)))
    head = None
    table = model.model.embed_tokens.weight
    if head_entry is not None:
        vocab, hidden = model.config.vocab_size, model.config.hidden_size
        group = head_entry[3]  # the checkpoint's (Q8_0: 32); the kernels take whole blocks of 32
        if group <= 0 or group % quant_cpu.QK or hidden % group:
            raise ValueError(f"a head of group size {group}")
        head = _packed_weight(mapped, HEAD, quant_cpu.Q8X8, vocab, hidden, group)
    params = []
    names = set()
    for name, param in model.named_parameters():
        names.add(name)
        tensor = mapped.tensors.get(name)
        shape = tuple(param.shape)
        if param is table and head is not None and model.config.tie_word_embeddings:
            shape = (0, shape[1])  # read from the head's rows (LlamaForCausalLM.embeds_from_head)
        if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != param.dtype:
            raise ValueError(f"{name} is not {param.dtype} {shape}")
        params.append((param, tensor))
    packed_names = {f"{n}#{p}" for n in mapped.packed for p in ("w", "scales", "mins")}
    if set(mapped.tensors) - names - packed_names:
        raise ValueError("it holds tensors the model does not")
    return params, natives, head
