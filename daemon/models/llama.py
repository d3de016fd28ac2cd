"""Our Llama-family decoder: Llama 2/3, SmolLM/SmolLM2, TinyLlama, Mistral, Qwen2/2.5, Qwen3.

It runs a flat ragged batch (no padding): ``input_ids[T]`` and ``positions[T]`` from any number of
sequences, with attention routed through an :class:`AttentionBackend` that reads and writes a
paged KV cache. q/k/v and gate/up projections are fused into one matmul each; the loader splits
checkpoint tensors into their shard of the fused weight.

Parameter names follow the Hugging Face checkpoints (``model.layers.N.self_attn...``) except for
the fused projections, so :meth:`LlamaForCausalLM.load_weights` needs only a small map.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmd.daemon.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from llmd.daemon.config import ModelConfig
from llmd.daemon.models.layers import Linear, LinearFactory, RMSNorm, RotaryEmbedding, apply_rope, dense_linear
from llmd.errors import WeightMismatchError
from llmd.kernels import q8_head
from llmd.quant.int8 import Int8Weight, dequantize_int8

log = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, make_linear: LinearFactory) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}.self_attn"
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.head_dim ** -0.5
        self.sliding_window = config.sliding_windows[layer_idx]
        self.qkv_proj = make_linear(f"{prefix}.qkv_proj", config.hidden_size, self.q_size + 2 * self.kv_size,
                                    config.qkv_bias, dtype)
        self.o_proj = make_linear(f"{prefix}.o_proj", self.q_size, config.hidden_size, config.o_proj_bias, dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
        meta: AttentionMetadata, backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = backend.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, make_linear: LinearFactory) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}.mlp"
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = make_linear(f"{prefix}.gate_up_proj", config.hidden_size, 2 * config.intermediate_size,
                                        False, dtype)
        self.down_proj = make_linear(f"{prefix}.down_proj", config.intermediate_size, config.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, make_linear: LinearFactory) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer_idx, dtype, make_linear)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, layer_idx, dtype, make_linear)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
        meta: AttentionMetadata, backend: AttentionBackend,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, make_linear: LinearFactory) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), _freeze=True,
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, make_linear) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)


# Checkpoint name pattern -> (our parameter name, shard index within the fused weight).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_FUSED_RE = re.compile(r"^(model\.layers\.\d+\.)(" + "|".join(re.escape(k) for k in _FUSED) + r")\.(weight|bias)$")
# Buffers some checkpoints carry that have no parameter here.
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")


def head_weight_name(config: ModelConfig) -> str:
    """The checkpoint name of the output head's weight (the embedding when tied)."""
    return "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache.

    Args:
        config: the model's shape.
        dtype: parameter and activation dtype (fp32 on the CPU).
        attn_backend: where attention runs; the torch reference by default.
        make_linear: builds the decoder projections (dense by default; llmd.quant.plan for
            quantised ones, which the loader fills through their ``load_rows``).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 attn_backend: AttentionBackend | None = None, make_linear: LinearFactory = dense_linear) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.attn_backend = attn_backend or TorchAttentionBackend()
        self.model = LlamaModel(config, dtype, make_linear)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)
        # The head's Q8_0 blocks when the checkpoint has them (GGUF): kept by load_weights, used
        # from prepare_head() on where the native kernel pays.
        self._head_blocks: Int8Weight | None = None
        self.head_q8: Int8Weight | None = None

    @property
    def head_name(self) -> str:
        return head_weight_name(self.config)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """Run a flat batch of ``T`` tokens; returns final hidden states ``[T, hidden_size]``."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, meta, self.attn_backend)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab_size]`` (fp32) for the rows of ``hidden`` that will be sampled."""
        if self.head_q8 is not None and hidden.shape[0] <= q8_head.MAX_ROWS:
            return q8_head.q8_head(hidden, self.head_q8.qweight, self.head_q8.scales)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def prepare_head(self) -> None:
        """Once loaded: keep the head's Q8_0 blocks for the native kernel (llmd.kernels.q8_head) where
        the dense head is a rounded copy of them (bf16/fp16 on the CPU); drop them elsewhere. In fp32
        the dense head holds the checkpoint's values exactly, and torch's matmul stays the reference.
        The kernel serves steps of up to q8_head.MAX_ROWS logits rows; larger ones (many sequences)
        take the dense copy, faster there."""
        q8, self._head_blocks = self._head_blocks, None
        device = self.model.embed_tokens.weight.device
        if q8 is not None and self.dtype != torch.float32 and device.type == "cpu" and q8_head.usable(q8.shape[1], q8.group_size):
            self.head_q8 = q8

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters.

        A quantised projection (a module with ``load_rows``) takes its part of the weight as it
        comes: a dense tensor, which it quantises, or quantised blocks, which it copies. The output
        head may come as INT8 blocks (GGUF Q8_0): they are kept for :meth:`prepare_head` besides the
        dense copy.

        Raises:
            WeightMismatchError: a tensor's shape disagrees with the config, or a parameter is
                never loaded.
        """
        params = dict(self.named_parameters())
        by_rows = {f"{name}.weight": m for name, m in self.named_modules() if hasattr(m, "load_rows")}
        missing = {name: self._num_shards(name) for name in [*params, *by_rows]}
        for name, tensor in weights:
            if _IGNORED_RE.search(name):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store the copy anyway
            if isinstance(tensor, Int8Weight) and name == self.head_name:
                self._head_blocks = tensor
                tensor = dequantize_int8(tensor)
            target_name, shard = name, None
            if m := _FUSED_RE.match(name):
                target, shard = _FUSED[m.group(2)]
                target_name = f"{m.group(1)}{target}.{m.group(3)}"
            if target_name in by_rows:
                module = by_rows[target_name]
                start, rows = self._rows(target_name, module.out_features, shard)
                self._check_shape(name, tensor, (rows, module.in_features))
                module.load_rows(start, tensor)
            elif target_name in params:
                param = params[target_name]
                start, rows = self._rows(target_name, param.shape[0], shard)
                dest = param.data.narrow(0, start, rows)
                self._check_shape(name, tensor, tuple(dest.shape))
                dest.copy_(tensor)
            else:
                log.warning("ignoring checkpoint tensor %s: no such parameter", name)
                continue
            missing[target_name] -= 1
        not_loaded = sorted(name for name, left in missing.items() if left > 0)
        if not_loaded:
            shown = ", ".join(not_loaded[:3]) + (" ..." if len(not_loaded) > 3 else "")
            raise WeightMismatchError(f"{len(not_loaded)} weights missing from the checkpoint: {shown}")

    @staticmethod
    def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
        if tuple(tensor.shape) != tuple(expected):
            raise WeightMismatchError(
                f"tensor {name} has shape {tuple(tensor.shape)} but the model config implies "
                f"{tuple(expected)}: the weights do not belong to this config"
            )

    def _num_shards(self, name: str) -> int:
        if ".qkv_proj." in name:
            return 3
        return 2 if ".gate_up_proj." in name else 1

    def _rows(self, name: str, total: int, shard: int | None) -> tuple[int, int]:
        """``(first row, row count)`` of ``shard`` within the fused weight ``name`` (all rows if None)."""
        if shard is None:
            return 0, total
        if ".qkv_proj." in name:
            sizes = [self.config.q_size, self.config.kv_size, self.config.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        return sum(sizes[:shard]), sizes[shard]
