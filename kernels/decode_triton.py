"""A whole decode step on the GPU in four kernel launches per decoder layer (issue 19).

Done layer by layer, a decode step of a small model is bound by the host launching kernels, not by
the GPU: ~37 launches per layer before the fusions, ~10 with one kernel per norm, RoPE and SiLU.
Here each layer is four, the elementwise work riding in the matmuls' launches and the attention's:

1. qkv projection, the input RMSNorm in its prologue (bias in its epilogue);
2. attention, straight from the qkv output: RoPE (and Qwen3's q/k norm), the new K/V written to
   the cache, split-K over the context combined in the same launch
   (llmd.kernels.attention_triton.decode_attention_new_token);
3. o projection, the residual add in its epilogue, in place into the residual stream;
4. the MLP (llmd.kernels.mlp_triton): the post-attention RMSNorm, gate/up, ``SiLU(gate) * up``,
   down and the residual add. Where it cannot be one launch (INT8 or dense weights, or a batch
   whose partial sums are too many for one program to combine) it is two: gate/up with the norm
   in its prologue, then down with SiLU x up in its prologue and the residual add in its epilogue.

The residual stream starts in the embeddings' tensor and is updated in place by 3; the one-launch
MLP writes ``x + MLP(x)`` to a second tensor (its programs read x until the last one is done), and
the two swap. The final norm is one more launch. Numerics are the layer-by-layer Triton path's,
rounding for rounding (the fused kernels round as the separate kernels do; only fp32 summation
orders differ), so a decode row's tokens do not depend on which path ran.

The model builds a :class:`DecodeStep` once loaded (``LlamaForCausalLM.prepare_decode``) when every
projection can take the fusions (the Triton INT4/INT8 matmuls, or dense weights through
:func:`dense_projection`), and hands it each pure decode step; steps with prompt chunks go layer
by layer. Everything it reads lives in tensors, so the step can be captured as a CUDA graph
(llmd.daemon.engine.cuda_graphs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmd.kernels import attention_triton, norm_act_triton
from llmd.kernels.mlp_triton import FusedMLP
from llmd.kernels.quant_matmul_triton import FusedMatmul

# A projection with its fusions bound (llmd.kernels.quant_matmul_triton.FusedMatmul, or
# :func:`dense_projection`): ``project(x, out=buffer)``, or ``project(x, residual)`` for one that
# adds into the residual stream in place; the bias included. Returns the output.
Projection = Callable[..., torch.Tensor]


def dense_projection(weight: torch.Tensor, bias: torch.Tensor | None, *,
                     norm: tuple[torch.Tensor, float] | None = None, silu: bool = False,
                     add_residual: bool = False) -> Projection:
    """A dense projection (cuBLAS) with the fusions as separate kernels."""
    def project(x: torch.Tensor, residual: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if (residual is not None) != add_residual:
            raise ValueError("a residual is " + ("required" if add_residual else "not taken") + " here")
        result = norm_act_triton.around_matmul(x, lambda h: F.linear(h, weight), norm=norm, silu=silu, bias=bias,
                                               residual=residual)
        return result if out is None else out.copy_(result)
    return project


class TwoLaunchMLP:
    """A layer's MLP as its two bound projections: ``gate_up`` with the post-attention norm,
    ``down`` with SiLU x up, adding into the residual stream in place. The interface of
    llmd.kernels.mlp_triton's :class:`FusedMLP` (which see): ``mlp(x, out, gate_up_out)``
    returns the tensor holding ``x + MLP(x)``, here always x."""

    def __init__(self, gate_up: Projection, down: Projection) -> None:
        self.gate_up, self.down = gate_up, down

    def __call__(self, x: torch.Tensor, out: torch.Tensor, gate_up_out: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up(x, out=gate_up_out), x)

    def bind(self, x: torch.Tensor, out: torch.Tensor,
             gate_up_out: torch.Tensor) -> tuple[Callable[[], object], torch.Tensor]:
        """The two launches bound (see :meth:`FusedMLP.bind`)."""
        gate_up, down = _bound(self.gate_up, x, out=gate_up_out), _bound(self.down, gate_up_out, x)
        return lambda: (gate_up(), down()), x


def bind_mlp(gate_up: Projection, down: Projection) -> FusedMLP | TwoLaunchMLP:
    """The MLP from its two bound projections, ``gate_up`` with the post-attention norm and
    ``down`` with SiLU x up and the residual add: one launch where llmd.kernels.mlp_triton fuses
    them (INT4 weights), else the two."""
    if isinstance(gate_up, FusedMatmul) and isinstance(down, FusedMatmul):
        try:
            return FusedMLP(gate_up, down)
        except ValueError:  # (INT8 weights, an odd intermediate size): the two launches
            pass
    return TwoLaunchMLP(gate_up, down)


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer as the step runs it: its projections bound with their fusions, ``qkv``
    with the input norm, ``o`` adding into the residual, the MLP (:func:`bind_mlp`); its
    attention bound to its shape."""

    qkv: Projection
    attention: attention_triton.NewTokenDecode
    o: Projection
    mlp: FusedMLP | TwoLaunchMLP
    gate_up_width: int  # gate/up's output features (2 x intermediate)


class DecodeStep:
    """The fused decode step of one model.

    Args:
        layers: the decoder layers, in order.
        final_norm: the final RMSNorm's weight; ``eps`` its epsilon.
    """

    takes_mixed_steps = False  # a step with prompt chunks goes layer by layer (the extend kernel)
    takes_prompt_chunks = False

    def __init__(self, layers: list[LayerWeights], final_norm: torch.Tensor, eps: float) -> None:
        self.layers, self.final_norm, self.eps = layers, final_norm, eps
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # By row count, allocated once: the residual stream (the embeddings go there, :meth:`embed`)
        # and a second one (a one-launch MLP writes x + MLP(x) there, and the two swap), and the
        # layers' qkv, attention and gate/up outputs, shared by every layer (each is consumed before
        # the next layer writes it): no allocation per launch.
        self._buffers: dict[int, _Buffers] = {}
        # By (rows, splits): the launches of a step on those buffers and the step's inputs, each
        # bound once (its arguments checked and packed), run as they are while the inputs are the
        # same tensors (llmd.daemon.engine.decode_inputs keeps them so).
        self._programs: dict[tuple[int, int], _Program] = {}

    def _buffers_for(self, rows: int, dtype: torch.dtype, device: torch.device) -> _Buffers:
        held = self._buffers.get(rows)
        if held is None or held.residual.dtype != dtype or held.residual.device != device:
            first = self.layers[0]
            att = first.attention
            new = functools.partial(torch.empty, dtype=dtype, device=device)
            hidden = (rows, self.final_norm.shape[0])
            held = self._buffers[rows] = _Buffers(new(hidden), new(hidden), new((rows, att.width)),
                                                  new((rows, att.num_heads, att.head_dim)),
                                                  new((rows, first.gate_up_width)))
        return held

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``input_ids`` (``weight``'s rows), written into this step's residual
        buffer for their row count: the same tensor every step of that count, so that a step on it
        runs its bound launches (:meth:`__call__`)."""
        held = self._buffers_for(input_ids.shape[0], weight.dtype, weight.device)
        return torch.index_select(weight, 0, input_ids, out=held.residual)

    @property
    def launches_per_layer(self) -> int:
        """A one-row step's launches per layer: 4 with one-launch MLPs, 5 with two GEMVs each."""
        return 4 if isinstance(self.layers[0].mlp, FusedMLP) else 5

    def bind_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The KV cache the steps read and write (one ``(K, V)`` per layer)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"a KV cache of {len(kv_caches)} layers for a model of {len(self.layers)}")
        if kv_caches and kv_caches[0][0].dtype == torch.int8:
            # NOTE: its attention writes the new K/V rows itself (NewTokenDecode), in the model's
            # dtype only; an int8 cache's steps go layer by layer (the write and attention kernels)
            raise ValueError("the fused Triton decode step writes KV caches of the model's dtype, not int8")
        self._caches = kv_caches
        self._programs.clear()  # bound to the old cache

    def bound_to(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        return kv_caches is self._caches

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """Run the step: ``x [M, hidden]`` the new tokens' embeddings (overwritten: it becomes the
        residual stream, with the step's second buffer of M rows), ``positions``/``slots`` ``[M]``,
        ``block_tables [M, W]``, ``seq_lens [M]`` int32 (the new token included) and their maximum
        on the host (the attention's split count). Returns the final norm's output ``[M, hidden]``
        in x's dtype."""
        rows = x.shape[0]
        held = self._buffers.get(rows)
        if held is not None and x is held.residual and self._caches:  # from embed(): the bound launches
            splits = self.layers[0].attention.splits(rows, max_seq_len, self._caches[0][0].shape[1])
            program = self._programs.get((rows, splits))
            if program is None or not program.takes(positions, slots, block_tables, seq_lens):
                program = self._programs[(rows, splits)] = self._bind(held, positions, slots, block_tables, seq_lens,
                                                                       splits)
            for launch in program.launches:
                launch()
            return norm_act_triton.add_rms_norm(program.result, None, self.final_norm, self.eps)[0]
        buffers = self._buffers_for(rows, x.dtype, x.device)
        residual, spare = x, buffers.spare
        qkv_out, attn_out, gate_up_out = buffers.qkv, buffers.attention, buffers.gate_up
        attn_rows = attn_out.view(rows, -1)
        for layer, (k_cache, v_cache) in zip(self.layers, self._caches):
            qkv = layer.qkv(residual, out=qkv_out)
            layer.attention(qkv, k_cache, v_cache, block_tables, seq_lens, positions, slots, max_seq_len, attn_out)
            layer.o(attn_rows, residual)
            if layer.mlp(residual, spare, gate_up_out) is spare:
                residual, spare = spare, residual
        return norm_act_triton.add_rms_norm(residual, None, self.final_norm, self.eps)[0]

    def _bind(self, held: _Buffers, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
              seq_lens: torch.Tensor, splits: int) -> _Program:
        """Every launch of a step on ``held`` and these inputs, in ``splits`` attention splits, bound."""
        x, spare, qkv, attn = held.residual, held.spare, held.qkv, held.attention
        attn_rows = attn.view(x.shape[0], -1)
        launches = []
        for layer, (k_cache, v_cache) in zip(self.layers, self._caches):
            launches += [_bound(layer.qkv, x, out=qkv),
                         layer.attention.bind(qkv, k_cache, v_cache, block_tables, seq_lens, positions, slots, attn,
                                              splits),
                         _bound(layer.o, attn_rows, x)]
            mlp, result = layer.mlp.bind(x, spare, held.gate_up)
            launches.append(mlp)
            if result is spare:
                x, spare = spare, x
        return _Program((positions, slots, block_tables, seq_lens), launches, x)


def _bound(call: Callable, *args, **kwargs) -> Callable[[], object]:
    """``call(*args, **kwargs)`` as a function of nothing: bound by the callee (checked once) where it
    can bind (FusedMatmul, FusedMLP), else as it is."""
    bind = getattr(call, "bind", None)
    return functools.partial(call, *args, **kwargs) if bind is None else bind(*args, **kwargs)


@dataclass(slots=True)
class _Buffers:
    """A step's tensors for one row count (see DecodeStep._buffers)."""

    residual: torch.Tensor
    spare: torch.Tensor
    qkv: torch.Tensor
    attention: torch.Tensor
    gate_up: torch.Tensor


@dataclass(slots=True)
class _Program:
    """A step's launches, bound to its inputs (see DecodeStep._programs)."""

    inputs: tuple[torch.Tensor, ...]
    launches: list[Callable[[], object]]
    result: torch.Tensor  # the residual buffer the last layer leaves its output in

    def takes(self, *inputs: torch.Tensor) -> bool:
        return all(a is b for a, b in zip(inputs, self.inputs))
