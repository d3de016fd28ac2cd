"""Our Llama-family decoder: Llama 2/3, SmolLM/SmolLM2, TinyLlama, Mistral, Qwen2/2.5, Qwen3.

It runs a flat ragged batch (no padding): ``input_ids[T]`` and ``positions[T]`` from any number of
sequences, with attention routed through an :class:`AttentionBackend` that reads and writes a
paged KV cache. q/k/v and gate/up projections are fused into one matmul each; the loader splits
checkpoint tensors into their shard of the fused weight.

Parameter names follow the Hugging Face checkpoints (``model.layers.N.self_attn...``) except for
the fused projections, so :meth:`LlamaForCausalLM.load_weights` needs only a small map.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from collections.abc import Iterable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llmd.daemon.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from llmd.daemon.model_config import ModelConfig
from llmd.daemon.models.layer_ops import LayerOps, Rotate, layer_ops_for
from llmd.daemon.models.layers import Linear, LinearFactory, RMSNorm, RotaryEmbedding, dense_linear
from llmd.errors import WeightMismatchError
from llmd.kernels import cpu_profile, decode_cpu, quant_cpu
from llmd.kernels.decode_cpu import DecodeStep
from llmd.quant.int8 import Int8Weight, dequantize_int8
from llmd.quant.int8_head import Int8Head

log = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]

# Prompt tokens at positions below this run through the native decode step, each a row at its own
# position, with the step's decode rows: in one native call a 358-token prompt was 1.24x as fast as
# layer by layer (AVX-512) and 1.19x (AVX2), where a chunk's many small ops and dtype casts cost; at
# 1,000 tokens of context the two were even with AVX-512 (1.06x faster at 2,000 with AVX2), where
# torch's flash attention, blocked like a matmul, beats the decode step's attention, which keeps
# every score of a query (2 cores, the default model, alternated in process).
STEP_PROMPT_POSITIONS = 1024


class FusedDecodeStep(Protocol):
    """A whole pure decode step in a few calls (llmd.kernels.decode_cpu's native step,
    llmd.kernels.decode_triton's fused one): from the new tokens' embeddings to the final norm."""

    takes_mixed_steps: bool  # also runs the decode rows of a step that has prompt chunks
    takes_prompt_chunks: bool  # also runs prompt tokens (below STEP_PROMPT_POSITIONS), each a row of its own

    def bind_cache(self, kv_caches: list[KVCache]) -> None: ...

    def bound_to(self, kv_caches: list[KVCache]) -> bool: ...

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The embeddings of a pure decode step's tokens, where the step wants them."""
        ...

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_seq_len: int) -> torch.Tensor: ...


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
        # [num_kv_heads, head_dim] fp32 subtracted from keys before they are stored: an int8 cache's
        # key centring (llmd.daemon.engine.key_centres); None for other caches
        self.key_centre: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, rotate: Rotate, kv_cache: KVCache, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, k)
        if self.key_centre is not None:  # in fp32: the int8 writers quantise from fp32
            k = k.float() - self.key_centre
        out = backend.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, make_linear: LinearFactory) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}.mlp"
        self.gate_up_proj = make_linear(f"{prefix}.gate_up_proj", config.hidden_size, 2 * config.intermediate_size,
                                        False, dtype)
        self.down_proj = make_linear(f"{prefix}.down_proj", config.intermediate_size, config.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, make_linear: LinearFactory) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer_idx, dtype, make_linear)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, layer_idx, dtype, make_linear)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rotate: Rotate, kv_cache: KVCache,
        meta: AttentionMetadata, backend: AttentionBackend, ops: LayerOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous layer's MLP output (the embeddings for the first layer, with
        ``residual=None``); returns this layer's MLP output and the residual stream before it (see
        llmd.daemon.models.layer_ops: the adds are fused into the norms)."""
        h, residual = ops.add_rms_norm(x, residual, self.input_layernorm)
        h = self.self_attn(h, rotate, kv_cache, meta, backend)
        h, residual = ops.add_rms_norm(h, residual, self.post_attention_layernorm)
        return self.mlp(h, ops), residual


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


# The projections of a decoder layer (module paths within it) and the checkpoint tensors each
# packs, in the order of their rows: declared once, here (the loader, --quant and the tests read it).
PACKED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
# Checkpoint name pattern -> (our parameter name, shard index within the fused weight).
_FUSED = {part: (ours, shard) for ours, parts in PACKED_PROJECTIONS.items() if len(parts) > 1
          for shard, part in enumerate(parts)}
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
        # The norms, RoPE and SiLU: fused Triton kernels on the Triton path, torch elsewhere.
        self.layer_ops = layer_ops_for(self.attn_backend.name)
        self.model = LlamaModel(config, dtype, make_linear)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)
        # The head's Q8_0 blocks when the checkpoint has them (GGUF): kept by load_weights, bound to
        # their kernel by prepare_head() (llmd.quant.int8_head).
        self._head_blocks: Int8Weight | None = None
        self.head_q8: Int8Head | None = None
        # Pure decode steps in one native call on the CPU, or four or five fused launches per layer on the
        # Triton path (prepare_decode), where every layer can take it.
        self.decode_step: FusedDecodeStep | None = None

    @property
    def head_name(self) -> str:
        return head_weight_name(self.config)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """Run a flat batch of ``T`` tokens; returns final hidden states ``[T, hidden_size]`` (in the
        model dtype; fp32 where the native decode step, once prepared, runs the rows)."""
        step = self.decode_step
        if step is not None and (1 in meta.query_lens or step.takes_prompt_chunks):
            if not step.bound_to(kv_caches):
                step.bind_cache(kv_caches)
            if meta.max_query_len == 1:
                x = self.embed(input_ids) if self.embeds_from_head else step.embed(input_ids,
                                                                                   self.model.embed_tokens.weight)
                return step(x, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens_tensor,
                            meta.max_seq_len)
            if step.takes_prompt_chunks or step.takes_mixed_steps:
                return self._forward_split(self.embed(input_ids), positions, kv_caches, meta)
        return self._forward_layers(self.embed(input_ids), positions, kv_caches, meta)

    def _forward_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                        meta: AttentionMetadata) -> torch.Tensor:
        ops = self.layer_ops
        rotate = ops.rotation(positions, self.model.rotary_emb, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rotate, kv_cache, meta, self.attn_backend, ops)
        return ops.add_rms_norm(x, residual, self.model.norm)[0]

    def _forward_split(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                       meta: AttentionMetadata) -> torch.Tensor:
        """A step with prompt chunks: the decode rows, and the prompt tokens the native step takes
        (those at positions below STEP_PROMPT_POSITIONS, each a row at its own position, as a verified
        span's drafts are), through the fused step; the other prompt tokens layer by layer, after
        them (they may attend to keys the step writes). NOTE: a row goes one way or the other by its
        own position, never by how its prompt was cut into chunks, so a prompt's KV cache is the same
        bits however the scheduler cut it; and a decoded token's numerics never depend on what
        shares its step (the step is batch-invariant, with an fp32 residual stream that a bf16
        model's layers would round)."""
        step = self.decode_step
        limit = STEP_PROMPT_POSITIONS if step.takes_prompt_chunks else 0
        lens = torch.tensor(meta.query_lens)
        seq_of_row = torch.repeat_interleave(torch.arange(len(meta.query_lens)), lens)
        decodes = lens[seq_of_row] == 1
        in_step = decodes | (positions < limit)  # (the native step's tensors are on the CPU)
        out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32)
        rows = torch.nonzero(in_step).flatten()
        if len(rows):
            # a prompt token's context ends with it; a decode row's length is the step's own
            lengths = torch.where(decodes, meta.seq_lens_tensor[seq_of_row], positions + 1)
            out[rows] = step(x[rows], positions[rows], meta.slot_mapping[rows], meta.block_tables[seq_of_row[rows]],
                             lengths[rows].to(torch.int32))
        rest = torch.nonzero(~in_step).flatten()
        if len(rest):
            # per sequence, its layer-by-layer tokens are the last of its chunk: a chunk of its own
            seqs, counts = (t.tolist() for t in torch.unique_consecutive(seq_of_row[rest], return_counts=True))
            rest_meta = AttentionMetadata(slot_mapping=meta.slot_mapping[rest], query_lens=counts,
                                          seq_lens=[meta.seq_lens[i] for i in seqs],
                                          block_tables=meta.block_tables[seqs])
            out[rest] = self._forward_layers(x[rest], positions[rest], kv_caches, rest_meta).float()
        return out

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab_size]`` (fp32) for the rows of ``hidden`` that will be sampled."""
        if self.head_q8 is not None:
            return self.head_q8(hidden)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden.to(weight.dtype), weight).float()

    def rows_per_pass(self) -> int:
        """Rows of a step that the projections take in one pass over their weights: a sequence's
        token and up to this many less one drafts are verified for about the price of their
        arithmetic alone (speculative decoding). The native CPU matmuls' own count (8 in every
        build); 4 elsewhere, which the GPU path has not been measured beyond."""
        on_native = self.model.embed_tokens.weight.device.type == "cpu" and any(
            getattr(m, "cpu_path", None) == "native" for layer in self.model.layers for m in layer.modules())
        return (quant_cpu.rows_per_pass() or 4) if on_native else 4

    def kernels(self) -> dict[str, str]:
        """What computes each part, as chosen at load (``llmd status``, ``llmd bench``): the
        projections' matmuls, decode steps, attention, the LM head, and on the CPU the profile."""
        device = self.model.embed_tokens.weight.device.type
        paths = sorted({m.cpu_path if device == "cpu" else device for layer in self.model.layers
                        for m in layer.modules() if hasattr(m, "cpu_path")}
                       | {m.quant_scheme for layer in self.model.layers for m in layer.modules()
                          if hasattr(m, "quant_scheme")})  # bitsandbytes
        lib = quant_cpu.library()
        vnni = ("" if lib is None else " (AVX-512 VNNI)" if lib.llmd_has_avx512()
                else " (VNNI)" if lib.llmd_has_vnni() else "")
        names = {"native": f"native int8-activation kernels{vnni}", "packed": "torch's packed kernels (bf16)",
                 "reference": "dequantise + matmul", "cuda": "Triton"}
        decode = "layer by layer"
        if isinstance(self.decode_step, DecodeStep):
            decode = "one native call per step"
        elif self.decode_step is not None:
            decode = f"fused Triton step ({self.decode_step.launches_per_layer} launches per layer)"
        out = {"projections": ", ".join(names.get(p, p) for p in paths) or f"dense {str(self.dtype)[6:]}",
               "decode": decode, "attention": self.attn_backend.name, "lm_head": f"dense {str(self.dtype)[6:]}"}
        if self.head_q8 is not None:
            where = "Triton" if self.head_q8.kernel == "triton" else "native"
            out["lm_head"] = f"{where} int8 (the checkpoint's Q8_0)"
        if device == "cpu":
            out["cpu_profile"] = cpu_profile.describe()
        return out

    def use_triton_kernels(self) -> None:
        """Bind what loading on a GPU binds, on whatever device the model is: the projections on the
        Triton INT4/INT8 matmuls, the Q8_0 LM head on the Triton INT8 one, and with the Triton
        attention backend the fused Triton decode step. On the CPU only under TRITON_INTERPRET=1, to
        test and count the GPU path here (tests, benchmarks/decode_launches.py); the attention
        backend is the caller's (Triton, for the whole GPU path)."""
        for module in self.modules():
            if hasattr(module, "cpu_path") and hasattr(module, "use"):  # llmd.quant's INT4/INT8 layers
                module.use("triton")
        if self.head_q8 is not None and self.head_q8.kernel == "native":  # the Q8_0 head, as a GPU holds it
            table, blocks = self.model.embed_tokens.weight, self.head_q8.weight()
            if self.embeds_from_head:  # the dense table, as prepare_head() keeps it on a GPU
                table.data = dequantize_int8(blocks).to(table.dtype)
            self.head_q8 = Int8Head(blocks, "triton", table.device, self.dtype)
        self.prepare_decode()

    def prepare_head(self) -> None:
        """Once loaded: bind the head's Q8_0 blocks to the kernel for the device
        (:meth:`Int8Head.for_device`: native INT8 on the CPU where the library builds, Triton INT8 on
        a GPU), whatever the model dtype. On the native kernel a tied embedding is then read from
        those blocks too (:meth:`embed`) and has no dense copy (a Llama 3.2 1B's table: 501 MiB in
        bf16 against the blocks' 266). Elsewhere the dense table is filled from the blocks: the
        embedding lookups (the Triton decode step reads it into its bound buffer), and the head
        where neither kernel runs."""
        q8, self._head_blocks = self._head_blocks, None
        if q8 is None:
            return
        table = self.model.embed_tokens.weight
        # NOTE: a native head is made in q8's own memory (consumed): q8 is read below only when the
        # head is not native (embeds_from_head is false then)
        self.head_q8 = Int8Head.for_device(q8, table.device, self.dtype, consume=True)
        if not self.config.tie_word_embeddings:
            return
        if self.embeds_from_head:
            table.data = table.new_empty(0, table.shape[1])  # frees the table (never written: never resident)
        else:
            table.data.copy_(dequantize_int8(q8))

    def bind_head(self, weight: quant_cpu.PackedWeight | None) -> None:
        """The head on the native INT8 kernel, from blocks already in its layout (a mapped cache of a
        prepared load, llmd.daemon.weights.prepared_cache, which also gives a tied table its empty
        shape); None: no INT8 head."""
        self._head_blocks = None
        self.head_q8 = None if weight is None else Int8Head.from_packed(weight)

    def use_dense_head(self) -> None:
        """Unbind the Q8_0 head's kernel: the head, and a tied table read from it, become the dense
        weights holding its values exactly (the exact path the quality tests hold the kernels to)."""
        if self.head_q8 is None:
            return
        if self.embeds_from_head:
            table = self.model.embed_tokens.weight
            table.data = dequantize_int8(self.head_q8.weight()).to(table.dtype)
        self.head_q8 = None

    @property
    def embeds_from_head(self) -> bool:
        """The token embeddings are the native head's INT8 rows (a tied GGUF Q8_0 table, prepare_head)."""
        return self.head_q8 is not None and self.head_q8.kernel == "native" and self.config.tie_word_embeddings

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``input_ids``, in the model dtype."""
        if self.embeds_from_head:
            return self.head_q8.rows(input_ids).to(self.dtype)
        return F.embedding(input_ids, self.model.embed_tokens.weight)

    def prepare_decode(self, lib: ctypes.CDLL | None = None) -> None:
        """Once loaded (after the projections' prepare()): run pure decode steps through a fused
        decode step where it can take every layer. On the CPU with the cpu attention backend, the
        native one (llmd.kernels.decode_cpu): fp32 or bf16, every projection on the native INT4/INT8
        kernels. With the Triton attention backend, the Triton one (llmd.kernels.decode_triton):
        every projection on the Triton INT4/INT8 matmuls or dense. Otherwise (or when
        ``LLMD_FUSED_DECODE=0``) decode steps keep the per-layer path; the log says why.
        ``lib``: another build of the native library (tests)."""
        self.decode_step = None
        triton = self.attn_backend.name == "triton"
        reason = self._triton_decode_unsupported() if triton else self._decode_step_unsupported()
        if reason is None:
            try:
                self.decode_step = self._build_triton_decode_step() if triton else self._build_decode_step(lib)
            except ValueError as e:
                reason = str(e)
        if reason is not None:
            log.info("decode steps run layer by layer: %s", reason)
        centres = [layer.self_attn.key_centre for layer in self.model.layers]
        if centres[0] is not None and self.decode_step is not None:  # a new step stores keys as the layers do
            if isinstance(self.decode_step, DecodeStep):
                self.decode_step.centre_keys(centres)
            else:
                self.decode_step = None
                log.info("decode steps run layer by layer: the fused Triton step does not centre keys")

    def centre_keys(self, centres: list[torch.Tensor] | None) -> None:
        """Subtract ``centres[layer]`` (``[num_kv_heads, head_dim]``) from every key the model stores from
        now on, on every path (layer by layer and the fused decode step), or nothing (None). Attention
        is unchanged by it (llmd.daemon.engine.key_centres); an int8 cache keeps more of the keys.

        A fused Triton decode step, which writes keys itself, is dropped for the layer-by-layer path.

        Raises:
            ValueError: centres of the wrong shape.
        """
        layers = self.model.layers
        shape = (self.config.num_kv_heads, self.config.head_dim)
        if centres is not None and (len(centres) != len(layers) or any(tuple(c.shape) != shape for c in centres)):
            raise ValueError(f"key centres must be {len(layers)} tensors of {shape[0]}x{shape[1]}")
        step = self.decode_step
        if isinstance(step, DecodeStep):
            step.centre_keys(centres)
        elif step is not None and centres is not None:  # it writes keys itself, uncentred
            self.decode_step = None
            log.info("decode steps run layer by layer: the fused Triton step does not centre keys")
        device = self.model.embed_tokens.weight.device
        for i, layer in enumerate(layers):
            layer.self_attn.key_centre = None if centres is None else centres[i].detach().float().to(device)

    def _projections(self) -> Iterable[nn.Module]:
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            yield from (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)

    def _triton_decode_unsupported(self) -> str | None:
        if os.environ.get("LLMD_FUSED_DECODE", "1") == "0":
            return "LLMD_FUSED_DECODE=0"
        if self.config.head_dim % 2:
            return f"RoPE needs an even head_dim, this model's is {self.config.head_dim}"
        for p in self._projections():
            if not (isinstance(p, Linear) or getattr(p, "cpu_path", None) == "triton"):
                return f"a projection ({type(p).__name__}) is neither dense nor on the Triton INT4/INT8 matmuls"
        return None

    def _build_triton_decode_step(self) -> FusedDecodeStep:
        from llmd.kernels import decode_triton  # imports triton: only on the Triton path
        from llmd.kernels.attention_triton import NewTokenDecode

        eps = self.config.rms_norm_eps

        def bind(p: nn.Module, **fusions) -> decode_triton.Projection:
            if isinstance(p, Linear):
                return decode_triton.dense_projection(p.weight, p.bias, **fusions)
            return p.bind_fused(self.dtype, **fusions)

        cfg = self.config
        splits = getattr(self.attn_backend, "decode_splits", None)  # forced in tests
        layers = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attention = NewTokenDecode(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.model.rotary_emb.inv_freq,
                                       attn.scale, attn.sliding_window,
                                       None if attn.q_norm is None else attn.q_norm.weight,
                                       None if attn.k_norm is None else attn.k_norm.weight, eps, splits)
            layers.append(decode_triton.LayerWeights(
                qkv=bind(attn.qkv_proj, norm=(layer.input_layernorm.weight, eps)), attention=attention,
                o=bind(attn.o_proj, add_residual=True),
                mlp=decode_triton.bind_mlp(bind(mlp.gate_up_proj, norm=(layer.post_attention_layernorm.weight, eps)),
                                           bind(mlp.down_proj, silu=True, add_residual=True)),
                gate_up_width=2 * cfg.intermediate_size))
        return decode_triton.DecodeStep(layers, self.model.norm.weight, eps)

    def _decode_step_unsupported(self) -> str | None:
        if os.environ.get("LLMD_FUSED_DECODE", "1") == "0":
            return "LLMD_FUSED_DECODE=0"
        if self.model.embed_tokens.weight.device.type != "cpu" or self.attn_backend.name != "cpu":
            return "the native decode step runs on the CPU with the cpu attention backend"
        if self.dtype not in decode_cpu.CACHE_DTYPES:
            return f"the native decode step takes fp32 or bf16 models, not {self.dtype}"
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if any(getattr(p, "native", None) is None for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                                mlp.down_proj)):
                return "some projections are not on the native INT4/INT8 kernels"
            if mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
                return "MLP projections with biases"
        return None

    def _build_decode_step(self, lib: ctypes.CDLL | None = None) -> DecodeStep:
        layers = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(decode_cpu.LayerWeights(
                input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
                qkv=attn.qkv_proj.native, o=attn.o_proj.native, gate_up=mlp.gate_up_proj.native,
                down=mlp.down_proj.native, qkv_bias=attn.qkv_proj.bias, o_bias=attn.o_proj.bias,
                q_norm=None if attn.q_norm is None else attn.q_norm.weight,
                k_norm=None if attn.k_norm is None else attn.k_norm.weight, sliding_window=attn.sliding_window))
        cfg = self.config
        return decode_cpu.DecodeStep(layers, self.model.norm.weight, self.model.rotary_emb.inv_freq, cfg.num_heads,
                                     cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.head_dim ** -0.5,
                                     torch.get_num_threads(), lib)

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
                if self.config.tie_word_embeddings:  # the table is filled, or dropped, by prepare_head()
                    self._check_shape(name, tensor, tuple(self.model.embed_tokens.weight.shape))
                    missing[name] -= 1
                    continue
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
        for ours, parts in PACKED_PROJECTIONS.items():
            if f".{ours}." in name:
                return len(parts)
        return 1

    def _rows(self, name: str, total: int, shard: int | None) -> tuple[int, int]:
        """``(first row, row count)`` of ``shard`` within the fused weight ``name`` (all rows if None)."""
        if shard is None:
            return 0, total
        if ".qkv_proj." in name:
            sizes = [self.config.q_size, self.config.kv_size, self.config.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        return sum(sizes[:shard]), sizes[shard]
