"""How a decoder layer's elementwise work runs: the residual add with the RMSNorm after it, RoPE of q
and k, and SiLU x up.

:class:`TorchLayerOps` is the reference (and what the CPU runs: its one-token steps go through the
native decode step, llmd.kernels.decode_cpu, and its prompt chunks are matmul-bound). On the GPU
the same work in torch is ~30 small kernel launches per layer, which bounds a decode step by the
host, not the device (issue 19); :class:`TritonLayerOps` runs each of the three as one fused
Triton kernel (llmd.kernels.norm_act_triton). The model picks one from its attention backend:
the Triton backend means the Triton path.

Both carry the residual stream the same way: ``add_rms_norm(x, residual, norm)`` returns
``(norm(x + residual), x + residual)``, with ``residual=None`` for the first layer, so a layer is
``h, r = add_norm(x, r); h = attn(h); h, r = add_norm(h, r); return mlp(h), r`` and the final norm
adds the last layer's MLP output. The sums are the same floating-point additions as the plain
``x = x + attn(norm(x))`` form, so the torch path's results are unchanged by this layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from llmd.daemon.models.layers import RMSNorm, RotaryEmbedding, apply_rope

# (q [T, Hq, D], k [T, Hk, D]) -> the rotated (q, k), at the positions of one forward.
Rotate = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class LayerOps(Protocol):
    name: str

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; ``(norm(x), x)`` without a residual. May write the
        sum into ``residual`` (the caller's residual stream) in place."""
        ...

    def rotation(self, positions: torch.Tensor, rotary: RotaryEmbedding, dtype: torch.dtype) -> Rotate:
        """RoPE at ``positions`` for one forward (every layer rotates at the same positions)."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``SiLU(gate) * up`` from the fused gate/up projection's output ``[T, 2I]`` (gate first)."""
        ...


class TorchLayerOps:
    name = "torch"

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        total = x if residual is None else x + residual
        return norm(total), total

    def rotation(self, positions: torch.Tensor, rotary: RotaryEmbedding, dtype: torch.dtype) -> Rotate:
        cos, sin = rotary.cos_sin(positions, dtype)  # once per forward, shared by every layer
        return lambda q, k: (apply_rope(q, cos, sin), apply_rope(k, cos, sin))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class TritonLayerOps:
    """One kernel launch each (llmd.kernels.norm_act_triton); cos/sin are computed in the RoPE
    kernel from the positions, so a step needs no per-step tables (and a CUDA graph captures
    nothing that depends on the host)."""

    name = "triton"

    def __init__(self) -> None:
        from llmd.kernels import norm_act_triton  # imports triton: only where the Triton path runs

        self._kernels = norm_act_triton

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kernels.add_rms_norm(x, residual, norm.weight, norm.eps)

    def rotation(self, positions: torch.Tensor, rotary: RotaryEmbedding, dtype: torch.dtype) -> Rotate:
        kernels, inv_freq = self._kernels, rotary.inv_freq
        return lambda q, k: kernels.rope_qk_(q, k, positions, inv_freq)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._kernels.silu_mul(gate_up)


def layer_ops_for(attention_backend: str) -> LayerOps:
    """The Triton kernels with the Triton attention backend (a GPU, or the interpreter in tests),
    the torch reference with any other."""
    return TritonLayerOps() if attention_backend == "triton" else TorchLayerOps()
