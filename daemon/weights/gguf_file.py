"""Reading a GGUF model file: its config, its tensors (dequantised, or as INT4/INT8 blocks) and its tokenizer.

The header is parsed by :mod:`llmd.daemon.weights.gguf_reader` (milliseconds, where the ``gguf``
package takes seconds), which bounds every read by the file: a short or garbled file becomes a
:class:`CorruptModelError` before any data is touched. The ``gguf`` package still dequantises.

GGUF names tensors the llama.cpp way (``blk.N.attn_q.weight``); :func:`hf_name` maps them to the
Hugging Face names our model loads. llama.cpp's converter permutes the rows of Llama's q and k
projections for its interleaved RoPE; :func:`unpermute_qk` undoes it for the rotate-half layout.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmd.daemon.model_config import ModelConfig, RopeConfig, supported_models_line
from llmd.daemon.weights.gguf_reader import GGUFFormatError, GGUFReader, TensorInfo
from llmd.errors import CorruptModelError, InvalidModelError, UnsupportedModelError, UnsupportedTensorTypeError
from llmd.quant.gguf_import import Q4Blocks
from llmd.quant.int4 import Int4Weight
from llmd.quant.int8 import Int8Weight

# GGUF architectures we read, and the model_type each becomes. Mistral GGUFs say "llama".
_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Types whose dequantisation the gguf package implements and llmd has tested.
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors with no parameter."""
    if m := _BLOCK_RE.match(gguf_name):
        layer_name = _LAYER_NAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{layer_name}.{m.group(3)}" if layer_name else None
    base, _, kind = gguf_name.rpartition(".")
    mapped = _GLOBAL_NAMES.get(base)
    return f"{mapped}.{kind}" if mapped else None


def unpermute_qk(weight: Any, num_heads: int) -> Any:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE -> rotate-half) on ``[out, ...]``."""
    half_dim = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half_dim, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _unpermute(data: torch.Tensor | Int4Weight | Int8Weight | Q4Blocks, num_heads: int
               ) -> torch.Tensor | Int4Weight | Int8Weight | Q4Blocks:
    """:func:`unpermute_qk` on a dense tensor, or on each row-indexed part of quantised blocks
    (rows are quantised independently, so moving whole rows is exact)."""
    if isinstance(data, Int4Weight):
        return Int4Weight(*(unpermute_qk(x, num_heads).contiguous() for x in (data.packed, data.scales, data.mins)),
                          data.group_size)
    if isinstance(data, Int8Weight):
        return Int8Weight(*(unpermute_qk(x, num_heads).contiguous() for x in (data.qweight, data.scales)),
                          data.group_size)
    if isinstance(data, Q4Blocks):
        return Q4Blocks(unpermute_qk(data.raw, num_heads).contiguous(), data.kind)
    return unpermute_qk(data, num_heads).contiguous()


class GGUFModelFile:
    """A validated GGUF file.

    Raises:
        CorruptModelError: the file is truncated, not GGUF, or a tensor lies outside it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = GGUFReader(path)
        except GGUFFormatError as e:
            raise CorruptModelError(f"{path} is truncated or corrupt and cannot be read as GGUF ({e}); "
                                    "download or convert it again") from None
        self.tensor_names = {t.name for t in self.reader.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        return self.reader.field(key, default)

    @property
    def architecture(self) -> str:
        arch = self.field("general.architecture")
        if arch not in _GGUF_ARCHS:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported; supported: "
                f"{', '.join(_GGUF_ARCHS)} ({supported_models_line()})"
            )
        return arch

    def config(self) -> ModelConfig:
        """The model config from the GGUF metadata.

        Raises:
            InvalidModelError: a field is missing, or of the wrong type (a string where a count goes).
            UnsupportedModelError: an architecture or RoPE scaling llmd does not run.
        """
        try:
            return self._config()
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidModelError(f"{self.path}: a GGUF metadata value has the wrong type ({e}); download or "
                                    "convert it again") from None

    def _config(self) -> ModelConfig:
        arch = self.architecture
        model_type = _GGUF_ARCHS[arch]

        def req(key: str) -> Any:
            value = self.field(f"{arch}.{key}")
            if value is None:
                raise InvalidModelError(f"{self.path}: GGUF metadata lacks {arch}.{key}")
            return value

        hidden = int(req("embedding_length"))
        num_heads = int(req("attention.head_count"))
        num_kv = int(self.field(f"{arch}.attention.head_count_kv", num_heads))
        num_layers = int(req("block_count"))
        head_dim = int(self.field(f"{arch}.attention.key_length", hidden // num_heads))
        vocab = self.field(f"{arch}.vocab_size")
        if vocab is None:
            tokens = self.field("tokenizer.ggml.tokens")
            if tokens is None:
                raise InvalidModelError(f"{self.path}: GGUF metadata has neither a vocab size nor a vocabulary")
            vocab = len(tokens)
        window = self.field(f"{arch}.attention.sliding_window")
        eos = [self.field(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(req("feed_forward_length")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            max_position_embeddings=int(self.field(f"{arch}.context_length", 2048)),
            rms_norm_eps=float(self.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope=self._rope(arch),
            tie_word_embeddings="output.weight" not in self.tensor_names,
            qkv_bias="blk.0.attn_q.bias" in self.tensor_names,
            o_proj_bias="blk.0.attn_output.bias" in self.tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensor_names,
            sliding_windows=(int(window) if window else None,) * num_layers,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        )

    def _rope(self, arch: str) -> RopeConfig:
        scaling = self.field(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise UnsupportedModelError(f"GGUF RoPE scaling {scaling!r} is not supported (none, linear)")
        freq_factors = None
        if "rope_freqs.weight" in self.tensor_names:  # llama3 scaling, precomputed by the converter
            t = next(t for t in self.reader.tensors if t.name == "rope_freqs.weight")
            freq_factors = tuple(float(x) for x in self._dequantize(t).reshape(-1))
        return RopeConfig(
            theta=float(self.field(f"{arch}.rope.freq_base", 10000.0)),
            rope_type="linear" if scaling == "linear" else "default",
            factor=float(self.field(f"{arch}.rope.scaling.factor", 1.0)),
            freq_factors=freq_factors,
        )

    def check_tensor_types(self) -> None:
        """Raise :class:`UnsupportedTensorTypeError` before loading if any tensor type is unknown."""
        for t in self.reader.tensors:
            if t.type_name not in SUPPORTED_TENSOR_TYPES:
                raise UnsupportedTensorTypeError(
                    f"{self.path}: tensor {t.name} is stored as GGUF type {t.type_name}, which llmd "
                    f"cannot read; supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}"
                )

    def _dequantize(self, t: TensorInfo) -> np.ndarray:
        from gguf import GGMLQuantizationType  # its import costs 0.1 s: only for tensors not held as blocks
        from gguf.quants import dequantize

        data = self.reader.data(t)
        if t.type_name == "F32":
            return data
        return np.asarray(dequantize(data, GGMLQuantizationType(t.type_id)), dtype=np.float32).reshape(t.shape)

    def tensor_types(self) -> dict[str, str]:
        """GGUF type name (``Q4_1``, ``F32``, ...) of every weight, by its Hugging Face name."""
        return {name: t.type_name for t in self.reader.tensors if (name := hf_name(t.name))}

    def iter_tensors(self, config: ModelConfig, blocks: Collection[str] = ()
                     ) -> Iterator[tuple[str, torch.Tensor | Int4Weight | Int8Weight]]:
        """Yield ``(hf_name, weight)`` for every weight, un-permuted: an fp32 tensor, or for the
        names in ``blocks`` the blocks: Q8_0 as an llmd INT8 weight, Q4_0/Q4_1 as they are
        (``Q4Blocks``, which an INT4 layer takes)."""
        from llmd.quant.gguf_import import import_q8_0

        importers = {"Q4_0": lambda raw: Q4Blocks.of(raw, "Q4_0"), "Q4_1": lambda raw: Q4Blocks.of(raw, "Q4_1"),
                     "Q8_0": lambda raw: import_q8_0(raw, consume=True)}  # read() gives fresh memory
        self.check_tensor_types()
        permute = self.architecture == "llama"
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is None:
                continue  # e.g. rope_freqs, already folded into the config
            if name in blocks:
                data = importers[t.type_name](self.reader.read(t))
            else:
                data = torch.from_numpy(np.require(self._dequantize(t), requirements=["C", "W"]))
            if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
                data = _unpermute(data, config.num_heads)
            elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
                data = _unpermute(data, config.num_kv_heads)
            yield name, data
            self.reader.release(t)  # copied by now: the peak RSS of a load is the model, not model + file

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensors)
