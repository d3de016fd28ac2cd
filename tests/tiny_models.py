"""Tiny random models for tests, built with transformers (the reference) and saved to disk.

Nothing here downloads: configs are written out by hand, weights are random (seeded), and GGUF
files are written with the ``gguf`` package the way llama.cpp's converter writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

# name -> (transformers config class name, config kwargs). Small enough to run in milliseconds,
# varied enough to cover each feature: GQA ratios, tied embeddings, RoPE scaling, qkv bias,
# q/k norm, explicit head_dim, sliding windows.
_COMMON = dict(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               initializer_range=0.2, rms_norm_eps=1e-5)
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(_COMMON, tie_word_embeddings=False)),
    "llama3": ("LlamaConfig", dict(_COMMON, tie_word_embeddings=False, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "smollm2": ("LlamaConfig", dict(_COMMON, hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                                    tie_word_embeddings=True, rope_theta=100000.0)),
    "tinyllama": ("LlamaConfig", dict(_COMMON, num_attention_heads=8, num_key_value_heads=1,
                                      tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(_COMMON, sliding_window=16, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(_COMMON, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(_COMMON, head_dim=32, tie_word_embeddings=False)),
}


def make_hf_model(name: str, seed: int = 0, **overrides: Any) -> Any:
    """A random-weight transformers model (fp32, eager attention) for one of ``TINY_CONFIGS``."""
    import transformers

    cls_name, kwargs = TINY_CONFIGS[name]
    config = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # tests generate a fixed number of tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


def perturbed_copy(model: Any, scale: float, seed: int = 1) -> Any:
    """A copy of ``model`` with each weight tensor moved by Gaussian noise of ``scale`` times its own
    spread: a draft model that agrees with the original often but not always (3%: ~60-70% of greedy
    drafts accepted on the tiny llama)."""
    import copy

    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return out


def save_hf_model(model: Any, path: Path, with_tokenizer: bool = False, tools: bool = False) -> Path:
    model.save_pretrained(str(path))
    if with_tokenizer:
        make_tiny_tokenizer(tools).save_pretrained(str(path))
    return path


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# The same, rendering tools the way Hermes-style templates do (Qwen 2.5, SmolLM3): a system turn
# listing them, an assistant's calls in <tool_call> tags, a tool's result in <tool_response> tags.
# Without tools or tool messages it renders exactly as CHAT_TEMPLATE.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "You may call these tools:\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call one as <tool_call>{"name": NAME, "arguments": {...}}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}"
    "{% if tools and loop.first and m['role'] == 'system' %}"
    "{% elif m['role'] == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for call in m.tool_calls %}<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>{{ m['content'] }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer(tools: bool = False) -> Any:
    """A byte-level tokenizer: ids 0-255 are bytes, then three special tokens, chat template included
    (with ``tools``, one that renders them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = TOOL_CHAT_TEMPLATE if tools else CHAT_TEMPLATE
    return fast


def hf_greedy(model: Any, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' own greedy ``generate`` (its KV cache, its masks), new tokens only."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=num_tokens, do_sample=False,
                             min_new_tokens=num_tokens, eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


def _permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    # What llama.cpp's converter does to Llama q/k rows (rotate-half -> interleaved RoPE).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model: Any, path: Path, quantize_type: str = "F32",
                     extra_tensor: tuple[str, str] | None = None, per_module: dict[str, str] | None = None,
                     head_type: str | None = None) -> Path:
    """Write a transformers Llama model as a llama.cpp-style GGUF file.

    Args:
        quantize_type: GGML type for the 2-D projection weights (``F32``, ``Q8_0``, ``Q4_0``...).
        head_type: GGML type for the output head (the token embedding when tied), e.g. ``Q8_0``;
            by default an untied head takes ``quantize_type`` and a tied one stays F32.
        per_module: GGML type for some projections instead, by module (``{"self_attn.v_proj": "Q8_0"}``).
        extra_tensor: ``(name, ggml_type)`` to add a zero-filled tensor of another type, for tests
            of unsupported types.
    """
    import gguf

    cfg = model.config
    arch = "llama"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    writer.add_float32(f"{arch}.rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
    names = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for hf, tensor in model.state_dict().items():
        module = ".".join(hf.split(".")[3:-1])
        qtype = gguf.GGMLQuantizationType[(per_module or {}).get(module, quantize_type)]
        w = tensor.detach().float().numpy()
        if hf == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif hf == "model.norm.weight":
            gname = "output_norm.weight"
        elif hf == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        else:
            parts = hf.split(".")  # model.layers.N.<module...>.weight
            gname = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"
        if hf.endswith("q_proj.weight"):
            w = _permute_for_gguf(w, cfg.num_attention_heads)
        elif hf.endswith("k_proj.weight"):
            w = _permute_for_gguf(w, cfg.num_key_value_heads)
        head = gname == ("token_embd.weight" if cfg.tie_word_embeddings else "output.weight")
        if head and head_type is not None:
            qtype = gguf.GGMLQuantizationType[head_type]
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32 and (
                gname != "token_embd.weight" or (head and head_type is not None)):
            writer.add_tensor(gname, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gname, w.astype(np.float32))
    if extra_tensor is not None:
        name, type_name = extra_tensor
        etype = gguf.GGMLQuantizationType[type_name]
        block_size, type_size = gguf.GGML_QUANT_SIZES[etype]
        writer.add_tensor(name, np.zeros((4, 256 // block_size * type_size), dtype=np.uint8), raw_dtype=etype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_tensor_offset_position(path: Path, tensor_name: str) -> int:
    """Byte position of ``tensor_name``'s data-offset field in the GGUF tensor-info table."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == tensor_name)
    # The info record is: name, n_dims, dims, type, offset; the reader keeps each part as a view.
    offset_part = tensor.field.parts[-1]
    return int(offset_part.ctypes.data - reader.data.ctypes.data)


def make_engine(model_dir: Path, attention: Any = None, quant: Any = None, dtype: torch.dtype = torch.float32,
                draft_dir: Path | None = None, **config: Any) -> Any:
    """An :class:`LLMEngine` over a saved model directory (tokenizer files included); attention on
    the torch reference unless ``attention`` (a backend) says otherwise; dense fp32 unless ``quant``
    (a QuantConfig) and ``dtype`` say otherwise; with ``draft_dir``, that model drafting for it
    (loaded the same way; pass ``speculative="draft"``)."""
    from llmd.daemon.engine.engine import EngineConfig, LLMEngine
    from llmd.daemon.loader import load_model
    from llmd.daemon.model_source import resolve_model
    from llmd.daemon.tokenizer import load_tokenizer, stop_token_ids

    source = resolve_model(model_dir)
    loaded = load_model(source, dtype=dtype, quant=quant, attention=attention)
    tokenizer = load_tokenizer(source)
    draft = None
    if draft_dir is not None:
        draft = load_model(resolve_model(draft_dir), dtype=dtype, quant=quant, attention=attention).model
    return LLMEngine(loaded.model, tokenizer, EngineConfig(**config),
                     eos_token_ids=stop_token_ids(tokenizer, loaded.config), draft_model=draft)


def run_engine(engine: Any, requests: list[tuple[int, str, list[int], Any]], max_steps: int = 100_000
               ) -> dict[str, list[int]]:
    """Drive ``engine`` until idle. ``requests`` are ``(arrival_step, id, prompt_ids, params)``;
    returns each request's generated token ids."""
    pending = sorted(requests, key=lambda r: r[0])
    out: dict[str, list[int]] = {r[1]: [] for r in requests}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, ids, params = pending.pop(0)
            engine.add_request(rid, ids, params)
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
        step += 1
        if step > max_steps:
            raise RuntimeError("engine did not drain")
    return out
