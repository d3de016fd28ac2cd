"""The model's shape, read from a Hugging Face ``config.json`` or from GGUF metadata.

One :class:`ModelConfig` describes every Llama-family model llmd implements; the differences
between families (qkv bias, q/k norm, RoPE scaling, sliding windows) are plain fields, so the model
code has no per-family branches beyond reading them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from llmd.errors import InvalidModelError, UnsupportedModelError

# model_type -> human name. Each is a Llama-shaped decoder that llmd.daemon.models.llama implements.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "Llama 2/3 (also SmolLM, SmolLM2, TinyLlama)",
    "mistral": "Mistral",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def supported_models_line() -> str:
    return ", ".join(f"{k} ({v})" for k, v in SUPPORTED_MODEL_TYPES.items())


@dataclass(slots=True)
class RopeConfig:
    """Rotary embedding parameters. ``freq_factors`` divides the inverse frequencies (GGUF llama3)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE scaling type {self.rope_type!r} is not supported; llmd supports "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if not (self.theta > 0 and math.isfinite(self.theta)):
            raise InvalidModelError(f"rope theta must be a positive number, got {self.theta}")
        if self.rope_type != "default" and not self.factor > 0:
            raise InvalidModelError(f"rope scaling factor must be positive, got {self.factor}")


@dataclass(slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Raises:
        InvalidModelError: a field is missing, non-positive or inconsistent (e.g. heads not
            divisible by KV heads).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on the q/k/v projections (Qwen2, Llama with attention_bias)
    o_proj_bias: bool = False  # bias on the output projection (Llama with attention_bias)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    # One entry per layer: the sliding attention window, or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model architecture {self.model_type!r} is not supported; "
                f"supported: {supported_models_line()}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidModelError(f"model config field {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise InvalidModelError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.sliding_windows:
            self.sliding_windows = (None,) * self.num_layers
        if len(self.sliding_windows) != self.num_layers:
            raise InvalidModelError(
                f"{len(self.sliding_windows)} per-layer attention types for {self.num_layers} layers"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older configs have `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    if isinstance(params.get("full_attention"), dict):  # per-layer-type form; Llama family uses one
        params = dict(params["full_attention"])
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return RopeConfig(
        theta=float(theta),
        rope_type=str(rope_type),
        factor=float(merged.get("factor", 1.0) or 1.0),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _sliding_windows_from_hf(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
        # Qwen only slides when asked to, and then only above max_window_layers.
        if not cfg.get("use_sliding_window", False) or not window:
            return (None,) * num_layers
    if not window:
        return (None,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types and len(layer_types) == num_layers:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if model_type in ("qwen2", "qwen3"):
        first = int(cfg.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    return (int(window),) * num_layers


def config_from_hf(cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """Build a :class:`ModelConfig` from a parsed ``config.json`` (and ``generation_config.json``).

    Raises:
        UnsupportedModelError: unknown ``model_type`` or an unsupported feature.
        InvalidModelError: a required field is missing or has the wrong type.
    """
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = cfg.get("architectures") or []
        name = model_type or (archs[0] if archs else "unknown")
        raise UnsupportedModelError(
            f"model architecture {name!r} is not supported; supported: {supported_models_line()}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"activation {act!r} is not supported (llmd implements silu)")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("MLP bias is not supported")
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        gen = generation_config or {}
        eos = _eos_ids(gen.get("eos_token_id", cfg.get("eos_token_id")))
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # NOTE: Qwen2 always has q/k/v bias and no o_proj bias; the others follow attention_bias.
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_proj_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_windows=_sliding_windows_from_hf(cfg, model_type, num_layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidModelError(f"config.json is missing or has a bad value for {e}") from None
