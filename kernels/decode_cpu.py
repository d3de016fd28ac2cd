"""A whole decode step in one native call (kernels/cpu/decode_step.c): every decoder layer of a
batch of one-token rows, over the paged KV cache, from embeddings to the final norm.

The model builds a :class:`DecodeStep` from plain tensors once it is loaded (``LlamaForCausalLM.
prepare_decode``) and hands it every step's decode rows, and the prompt tokens of short contexts
(``llama.STEP_PROMPT_POSITIONS``).
Everything the C reads lives in tensors this object holds: the weights (those of the quantised
layers, shared, not copied), the norms in fp32, the KV cache pointers (:meth:`bind_cache`, again
after a reload) and a workspace that grows with the batch and is then reused.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int32, c_int64, c_void_p
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmd.kernels import kv_format
from llmd.kernels.native import library
from llmd.kernels.quant_cpu import PackedWeight

# the caches it reads, by their kind in kernels/cpu/kv_row.h (rows as llmd.kernels.kv_format lays them out)
CACHE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
CACHE_DTYPES = tuple(CACHE_KINDS)


class _Linear(ctypes.Structure):
    _fields_ = [("kind", c_int32), ("group", c_int32), ("n", c_int64), ("k", c_int64), ("w", c_void_p),
                ("scales", c_void_p), ("mins", c_void_p), ("bias", c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", c_void_p), ("post_norm", c_void_p), ("q_norm", c_void_p), ("k_norm", c_void_p),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("k_cache", c_void_p), ("v_cache", c_void_p), ("window", c_int64), ("k_centre", c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", c_int64), ("hidden", c_int64), ("num_heads", c_int64), ("num_kv_heads", c_int64),
                ("head_dim", c_int64), ("intermediate", c_int64), ("block_size", c_int64), ("cache_kind", c_int32),
                ("nthreads", c_int32), ("eps", c_float), ("scale", c_float), ("inv_freq", c_void_p),
                ("final_norm", c_void_p), ("layers", POINTER(_Layer))]


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer as the native step reads it."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: PackedWeight
    o: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    sliding_window: int | None = None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecodeStep:
    """The native decode step of one model.

    Args:
        layers: the decoder layers' weights, in order.
        final_norm: the final RMSNorm's weight.
        inv_freq: RoPE inverse frequencies ``[head_dim / 2]`` (scaling applied).
        num_heads, num_kv_heads, head_dim, eps: the model's shape; ``scale`` the attention's.
        threads: OpenMP threads (torch's count).
        lib: another build of the native library (tests).

    Raises:
        ValueError: shapes the native step does not take (the caller keeps the torch path).
    """

    takes_mixed_steps = True  # a step's decode rows run here whatever shares the step
    takes_prompt_chunks = True  # prompt tokens too, each a row like a verified span's draft

    def __init__(self, layers: list[LayerWeights], final_norm: torch.Tensor, inv_freq: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, eps: float, scale: float, threads: int,
                 lib: ctypes.CDLL | None = None) -> None:
        self._lib = lib or library()
        if self._lib is None:
            raise ValueError("the native CPU library is not available")
        hidden = final_norm.shape[0]
        intermediate = layers[0].down.k
        if head_dim % 2 or num_heads % num_kv_heads or any(d % 32 for d in (hidden, num_heads * head_dim,
                                                                              intermediate)):
            raise ValueError(f"shapes the native decode step does not take (hidden {hidden}, heads {num_heads}x"
                             f"{head_dim}, intermediate {intermediate})")
        keep: list[torch.Tensor] = []  # everything the C points at stays alive with this object

        def f32(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach().float().contiguous()
            keep.append(t)
            return t.data_ptr()

        def linear(w: PackedWeight, bias: torch.Tensor | None) -> _Linear:
            return _Linear(w.kind, w.group_size, w.n, w.k, _ptr(w.w), _ptr(w.scales), _ptr(w.mins), f32(bias))

        self._layers = (_Layer * len(layers))()
        for struct, lw in zip(self._layers, layers):
            struct.input_norm, struct.post_norm = f32(lw.input_norm), f32(lw.post_norm)
            struct.q_norm, struct.k_norm = f32(lw.q_norm), f32(lw.k_norm)
            struct.qkv, struct.o = linear(lw.qkv, lw.qkv_bias), linear(lw.o, lw.o_bias)
            struct.gate_up, struct.down = linear(lw.gate_up, None), linear(lw.down, None)
            struct.window = lw.sliding_window or 0
        self._weights = layers
        self._model = _Model(len(layers), hidden, num_heads, num_kv_heads, head_dim, intermediate, 0, 0, threads, eps,
                             scale, f32(inv_freq), f32(final_norm), self._layers)
        self._keep = keep
        self._centres: list[torch.Tensor] = []
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._workspace = torch.empty(0, dtype=torch.uint8)
        self._need: dict[int, int] = {}  # workspace bytes by row count
        self.hidden = hidden

    def centre_keys(self, centres: list[torch.Tensor] | None) -> None:
        """Subtract ``centres[layer]`` (``[num_kv_heads, head_dim]``) from every key before it is stored,
        or nothing (None): an int8 cache's key centring (llmd.daemon.engine.key_centres)."""
        if centres is not None and len(centres) != len(self._layers):
            raise ValueError(f"{len(centres)} key centres for {len(self._layers)} layers")
        kv_size = self._model.num_kv_heads * self._model.head_dim
        self._centres = [] if centres is None else [c.detach().float().reshape(-1).contiguous() for c in centres]
        if any(c.numel() != kv_size for c in self._centres):
            raise ValueError(f"key centres must have num_kv_heads x head_dim = {kv_size} values")
        for i, struct in enumerate(self._layers):
            struct.k_centre = self._centres[i].data_ptr() if self._centres else None

    def bind_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point the layers at a KV cache (per layer ``[num_blocks, block_size, kv_heads, row]`` K and V,
        fp32, bf16 or int8 (llmd.kernels.kv_format), contiguous).

        Raises:
            ValueError: a cache the native step cannot read.
        """
        k0 = kv_caches[0][0]
        if k0.dtype not in CACHE_DTYPES or any(not (k.is_contiguous() and v.is_contiguous()) or k.dtype != k0.dtype
                                               or v.dtype != k0.dtype for k, v in kv_caches):
            raise ValueError(f"the native decode step reads contiguous fp32, bf16 or int8 KV caches, not {k0.dtype}")
        if kv_format.head_dim_of(k0) != self._model.head_dim:
            raise ValueError(f"a KV cache of heads of {kv_format.head_dim_of(k0)} values for a model of "
                             f"{self._model.head_dim}")
        for struct, (k, v) in zip(self._layers, kv_caches):
            struct.k_cache, struct.v_cache = k.data_ptr(), v.data_ptr()
        self._model.block_size = k0.shape[1]
        self._model.cache_kind = CACHE_KINDS[k0.dtype]
        self._caches = kv_caches

    def _workspace_bytes(self, rows: int) -> int:
        need = self._need.get(rows)
        if need is None:
            need = self._need[rows] = self._lib.llmd_decode_workspace_bytes(ctypes.addressof(self._model), rows)
        return need

    def bound_to(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        return kv_caches is self._caches

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The new tokens' embeddings (the native step copies them to fp32 itself)."""
        return F.embedding(input_ids, weight)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_seq_len: int | None = None) -> torch.Tensor:
        """Run the step: ``x [M, hidden]`` the new tokens' embeddings (any float dtype; an fp32 one is
        overwritten), ``positions``/``slots`` ``[M]`` int64, ``block_tables [M, W]`` int64, ``seq_lens
        [M]`` int32 (the new token included); ``max_seq_len`` is not needed here. Returns the final
        norm's output ``[M, hidden]`` fp32."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        m = x.shape[0]
        if self._workspace.numel() < (need := self._workspace_bytes(m)):
            self._workspace = torch.empty(need, dtype=torch.uint8)
        out = torch.empty(m, self.hidden)
        status = self._lib.llmd_decode_step(ctypes.addressof(self._model), x.data_ptr(), m, positions.data_ptr(),
                                            slots.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
                                            seq_lens.data_ptr(), self._workspace.data_ptr(), out.data_ptr())
        if status != 0:
            raise ValueError(f"the native decode step refused a batch of {m} rows")
        return out
