"""The attention backends and the batch metadata every backend reads.

The model never sees blocks or sequences: each attention layer hands its new q/k/v and its slice
of the KV cache to the backend together with one :class:`AttentionMetadata` built per step by
whoever drives the model (the engine's model runner, or the simple generator the tests use).

Three backends: :class:`TorchAttentionBackend` (the reference), :class:`CpuAttentionBackend` (the
CPU's: the reference with decode rows in the native library) and :class:`TritonAttentionBackend`
(CUDA's; on the CPU only in the Triton interpreter, for tests).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from llmd.daemon.device import host_tensor
from llmd.kernels import attention_ref

log = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass(slots=True)
class AttentionMetadata:
    """One step's flat ragged batch, as attention needs it.

    Attributes:
        slot_mapping: ``[T]`` cache slot of every new token (negative: a padding row, not written).
        query_lens: new tokens per sequence (host list; sums to T).
        seq_lens: total length per sequence after this step (host list).
        block_tables: ``[num_seqs, max_blocks]`` physical block ids.

    Derived once per step (not once per layer), unless given (persistent buffers,
    daemon/engine/decode_inputs.py): ``max_query_len`` and ``max_seq_len`` on the host,
    ``query_start_loc`` ``[num_seqs + 1]`` and ``seq_lens_tensor`` ``[num_seqs]`` (int32) on the device.
    """

    slot_mapping: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor | None = None
    seq_lens_tensor: torch.Tensor | None = None
    max_query_len: int = field(init=False)
    max_seq_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.max_query_len = max(self.query_lens)
        self.max_seq_len = max(self.seq_lens)
        device = self.slot_mapping.device
        if self.query_start_loc is None:
            self.query_start_loc = host_tensor([0, *itertools.accumulate(self.query_lens)], torch.int32, device)
        if self.seq_lens_tensor is None:
            self.seq_lens_tensor = host_tensor(self.seq_lens, torch.int32, device)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


class AttentionBackend(Protocol):
    name: str  # what `--attention` calls it

    def unsupported(self, block_size: int, head_dim: int | None = None,
                    dtype: torch.dtype | None = None) -> str | None:
        """None if this backend runs a KV cache of these blocks (and heads and dtype, if given),
        else why not."""
        ...

    def unsupported_cache(self, cache_dtype: torch.dtype, model_dtype: torch.dtype) -> str | None:
        """None if this backend reads and writes a KV cache of ``cache_dtype`` (``--kv-cache-dtype``)
        for a model of ``model_dtype``, else why not and what to use (one line)."""
        ...

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Write key/value into the cache, then attend. Shapes: q ``[T, H, D]``, k/v ``[T, KVH, D]``."""
        ...


class TorchAttentionBackend:
    """The reference backend: correct everywhere, fast nowhere."""

    name = "torch"

    def decode_fn(self, cache_dtype: torch.dtype) -> attention_ref.DecodeFn:
        """What computes the decode rows over a cache of ``cache_dtype`` (the cpu backend plugs in
        its native kernel here)."""
        return attention_ref.decode_attention

    def write_fn(self, cache_dtype: torch.dtype) -> Callable[..., None]:
        """What writes a step's K/V into a cache of ``cache_dtype`` (the cpu backend plugs in its
        native int8 writer here)."""
        return attention_ref.write_kv

    def unsupported(self, block_size: int, head_dim: int | None = None,
                    dtype: torch.dtype | None = None) -> str | None:
        return None

    def unsupported_cache(self, cache_dtype: torch.dtype, model_dtype: torch.dtype) -> str | None:
        return None  # any (llmd.kernels.kv_format)

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        self.write_fn(k_cache.dtype)(k_cache, v_cache, key, value, meta.slot_mapping)
        decode = self.decode_fn(k_cache.dtype)
        if meta.max_query_len == 1:  # a pure decode step: the lengths tensor built once, not one per layer
            return decode(query, k_cache, v_cache, meta.seq_lens_tensor, meta.block_tables, scale, sliding_window)
        return attention_ref.paged_attention(
            query, k_cache, v_cache, meta.query_lens, meta.seq_lens, meta.block_tables, scale,
            sliding_window, decode=decode,
        )


class CpuAttentionBackend(TorchAttentionBackend):
    """The reference, with its decode rows (every row of a pure decode step) computed by the native
    library's paged decode kernel (llmd.kernels.attention_cpu): one call per layer instead of a
    gather of every context into a padded tensor and a dozen torch ops. KV caches of fp32 or bf16;
    any other dtype takes the reference throughout."""

    name = "cpu"

    def decode_fn(self, cache_dtype: torch.dtype) -> attention_ref.DecodeFn:
        from llmd.kernels import attention_cpu

        if cache_dtype in attention_cpu.CACHE_DTYPES:
            return attention_cpu.decode_attention
        return attention_ref.decode_attention  # e.g. --dtype float16: the reference reads any dtype

    def write_fn(self, cache_dtype: torch.dtype) -> Callable[..., None]:
        from llmd.kernels import attention_cpu

        return attention_cpu.write_kv if cache_dtype == torch.int8 else attention_ref.write_kv


def native_attention_usable() -> str | None:
    """None if the cpu backend can run here, else why not."""
    from llmd.kernels.native import library

    if library() is None:
        return "the native CPU library could not be built (see the log)"
    return None


class TritonAttentionBackend:
    """Triton kernels (llmd.kernels.attention_triton): a pure decode step runs the decode kernel
    (split-K over long contexts); a step with any prompt chunk runs the extend kernel for all its
    sequences, decode rows included, so each layer launches one attention kernel per step.

    Args:
        decode_splits: force the decode kernel's split count (tests); default: by batch and length.
    """

    name = "triton"

    def __init__(self, decode_splits: int | None = None) -> None:
        from llmd.kernels import attention_triton

        self._kernels = attention_triton
        self.decode_splits = decode_splits

    def unsupported(self, block_size: int, head_dim: int | None = None,
                    dtype: torch.dtype | None = None) -> str | None:
        return self._kernels.unsupported(block_size, head_dim, dtype)

    def unsupported_cache(self, cache_dtype: torch.dtype, model_dtype: torch.dtype) -> str | None:
        if cache_dtype not in (model_dtype, torch.int8):
            return (f"the Triton attention kernels read a KV cache of the model's dtype ({str(model_dtype)[6:]}) or "
                    f"int8, not {str(cache_dtype)[6:]}; use --kv-cache-dtype auto or --attention torch")
        return None

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        kernels = self._kernels
        kernels.write_kv(k_cache, v_cache, key, value, meta.slot_mapping)
        if meta.max_query_len == 1:
            return kernels.decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_tensor,
                                            meta.max_seq_len, scale, sliding_window, self.decode_splits)
        return kernels.extend_attention(query, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                        meta.seq_lens_tensor, meta.max_query_len, scale, sliding_window)


# The oldest GPUs the kernels are sized for (64 KiB of shared memory: Turing, sm_75).
MIN_CUDA_CAPABILITY = (7, 5)


def triton_usable(device: str) -> str | None:
    """None if the Triton backend can run on ``device``, else why not (one line)."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the Triton attention backend runs on CUDA GPUs (on the CPU only under TRITON_INTERPRET=1, for tests)"
    if device == "cuda" and torch.cuda.get_device_capability() < MIN_CUDA_CAPABILITY:
        major, minor = torch.cuda.get_device_capability()
        return (f"the Triton attention kernels need a GPU of compute capability 7.5 (Turing) or newer, "
                f"this one has {major}.{minor}")
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the Triton attention backend needs the triton package (pip install triton)"
    return None


def make_attention_backend(name: str, device: str) -> AttentionBackend:
    """The backend ``--attention`` names for ``device``: ``auto`` is Triton on CUDA (when triton is
    installed), the cpu backend on the CPU (when the native library builds), else the torch reference.

    Raises:
        ValueError: an unknown name, or ``triton`` / ``cpu`` where it cannot run.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu" and device != "cpu":
        raise ValueError("--attention cpu runs on the CPU only (use --device cpu)")
    if device == "cpu" and name in ("auto", "cpu"):
        backend, reason = CpuAttentionBackend, native_attention_usable()
    else:
        backend, reason = TritonAttentionBackend, triton_usable(device)
    if reason is None:
        return backend()
    if name == "auto":
        log.warning("%s; attention runs on the slow torch reference path", reason)
        return TorchAttentionBackend()
    raise ValueError(f"--attention {name}: {reason}")
