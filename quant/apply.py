"""Quantise a loaded model's projections in place (``--quant``), and count what the weights take.

The projections of every decoder layer (fused qkv, o, fused gate/up, down) become
:class:`Int8Linear` or :class:`Int4Linear`; embeddings, norms and the (usually tied) LM head stay
as loaded. Quantising happens after loading, from the loaded weights; for a GGUF file those are
its blocks dequantised, so INT4 g32 of a Q4_1 file reproduces its values (see
benchmarks/quant_quality.py), but the native import without that round trip is still to come.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from llmd.daemon.models.layers import Linear
from llmd.quant.int4 import Int4Linear, quantize_int4
from llmd.quant.int8 import Int8Linear, quantize_int8

QUANT_SCHEMES = ("none", "int8", "int4")
_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass(slots=True)
class QuantConfig:
    """``scheme``: none, int8 (per output channel unless ``group_size``) or int4 (asymmetric,
    ``group_size`` 32 by default: coarser groups cost a lot of quality on small models).
    Raises ``ValueError`` on unknown schemes or group sizes."""

    scheme: str = "none"
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.scheme not in QUANT_SCHEMES:
            raise ValueError(f"quantisation must be one of {', '.join(QUANT_SCHEMES)}, got {self.scheme!r}")
        if self.scheme == "int4" and self.group_size is None:
            self.group_size = 32
        if self.group_size is not None and self.group_size not in (32, 64, 128):
            raise ValueError(f"group size must be 32, 64 or 128, got {self.group_size}")

    def describe(self) -> str:
        if self.scheme == "none":
            return "none (weights dequantised on load)"
        groups = f"g{self.group_size}" if self.group_size else "per channel"
        return f"{self.scheme} {groups} (projections; embeddings and LM head unquantised)"


def quantize_linears(model: nn.Module, config: QuantConfig) -> None:
    """Replace each decoder layer's projections with quantised ones (no-op for ``none``).

    Raises:
        ValueError: the group size does not divide a projection's input size.
    """
    if config.scheme == "none":
        return
    for layer in model.model.layers:
        for path in _PROJECTIONS:
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            dense: Linear = getattr(parent, name)
            w = dense.weight.data.float()
            bias = None if dense.bias is None else dense.bias.data.float()
            if config.scheme == "int8":
                quantized: nn.Module = Int8Linear(quantize_int8(w, config.group_size), bias)
            else:
                quantized = Int4Linear(quantize_int4(w, config.group_size or 32), bias)
            setattr(parent, name, quantized)


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters and buffers take as held (caches of packed copies excluded)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
