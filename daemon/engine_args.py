"""The one front door to the runtime: every setting that builds it, and the building.

The daemon (``llmd start``), ``llmd.LLM`` and ``llmd generate/bench --in-process`` all build the
runtime here, in one order: the settings checked (cheap, before anything slow); then the model
resolved, the device, dtype and attention backend chosen, and the block size checked against the
backend; then the model loaded, the tokenizer, and the engine with its KV pool.

Each setting has one name, the option's in llmd.config (the flag, the ``LLMD_*`` variable and the
config-file key say the same), and its default is written there once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from llmd.config import OPTIONS
from llmd.daemon.attention import AttentionBackend, make_attention_backend
from llmd.daemon.device import resolve_device, resolve_dtype
from llmd.daemon.engine.engine import EngineConfig, LLMEngine
from llmd.daemon.loader import LoadedModel, load_model
from llmd.daemon.model_source import ModelSource, resolve_model
from llmd.daemon.models import LlamaForCausalLM
from llmd.daemon.quantization import QuantConfig
from llmd.daemon.tokenizer import load_tokenizer, read_chat_template, stop_token_ids, use_chat_template


def _default(name: str) -> Any:
    return field(default=OPTIONS[name].default)


@dataclass(slots=True)
class EngineArgs:
    """What the runtime is built from; :meth:`build` builds it.

    The first fields are the options of the same name (llmd.config); the last three are not user
    settings: ``num_blocks`` sets the KV pool exactly (tests), ``max_model_len`` caps the context
    below the model's, ``paced`` is EngineConfig's (off for the offline ``llmd.LLM``).

    Raises:
        ValueError: a bad value, naming the fix (at construction, before anything is loaded).
    """

    model: str | None = _default("model")
    device: str = _default("device")
    dtype: str = _default("dtype")
    quant: str = _default("quant")
    group_size: int | None = _default("group_size")
    weights_cache: bool = _default("weights_cache")
    attention: str = _default("attention")
    kv_cache_mb: int | None = _default("kv_cache_mb")
    kv_cache_dtype: str = _default("kv_cache_dtype")
    gpu_memory_fraction: float = _default("gpu_memory_fraction")
    block_size: int = _default("block_size")
    max_num_seqs: int = _default("max_num_seqs")
    max_batched_tokens: int = _default("max_batched_tokens")
    prefix_cache: bool = _default("prefix_cache")
    cuda_graphs: bool = _default("cuda_graphs")
    speculative: str = _default("speculative")
    draft_model: str | None = _default("draft_model")
    chat_template: str | None = _default("chat_template")
    models_dir: str | None = _default("models_dir")
    num_blocks: int | None = None
    max_model_len: int | None = None
    paced: bool = True

    def __post_init__(self) -> None:
        for name in ("device", "dtype", "quant", "attention"):  # the choices, as the flags check them
            value = getattr(self, name)
            if value not in OPTIONS[name].choices:
                raise ValueError(f"{name} must be one of {', '.join(OPTIONS[name].choices)}, got {value!r}")
        self.engine_config()
        self.quant_config()
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("--speculative draft needs --draft-model NAME, and --draft-model needs "
                             "--speculative draft")

    @classmethod
    def from_settings(cls, values: Mapping[str, Any], **overrides: Any) -> EngineArgs:
        """The runtime's settings out of all the effective ones (llmd.config.resolve), others ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names} | overrides)

    def engine_config(self) -> EngineConfig:
        """The engine's knobs, checked."""
        return EngineConfig(block_size=self.block_size, kv_cache_mb=self.kv_cache_mb, num_blocks=self.num_blocks,
                            max_num_seqs=self.max_num_seqs, max_batched_tokens=self.max_batched_tokens,
                            max_model_len=self.max_model_len, prefix_cache=self.prefix_cache,
                            gpu_memory_fraction=self.gpu_memory_fraction, cuda_graphs=self.cuda_graphs,
                            speculative=self.speculative, kv_cache_dtype=self.kv_cache_dtype,
                            paced=self.paced)

    def quant_config(self) -> QuantConfig:
        """``--quant`` and ``--group-size``, checked."""
        return QuantConfig(self.quant, self.group_size)

    def resolve(self) -> ResolvedArgs:
        """The model found, the device, dtype and attention backend chosen, the block size checked
        against the backend: everything before the slow load.

        Raises:
            ValueError: a backend that cannot run here or this block size (the message says what
                to use instead).
            LlmdError subclasses: the model is not found.
        """
        device = resolve_device(self.device)
        attention = make_attention_backend(self.attention, device)
        if reason := attention.unsupported(self.block_size):  # before the slow load; head_dim is checked after
            raise ValueError(f"{reason}; use --attention torch")
        source = resolve_model(self.model, self.models_dir)
        draft = None if self.draft_model is None else resolve_model(self.draft_model, self.models_dir)
        return ResolvedArgs(self, source, device, resolve_dtype(self.dtype, device), attention, draft)

    def build(self) -> Runtime:
        """:meth:`resolve`, then :meth:`ResolvedArgs.load`."""
        return self.resolve().load()


@dataclass(slots=True)
class ResolvedArgs:
    """The settings with the model, device, dtype and attention backend decided; :meth:`load`."""

    args: EngineArgs
    source: ModelSource
    device: str
    dtype: torch.dtype
    attention: AttentionBackend
    draft_source: ModelSource | None = None  # --draft-model

    def load_model(self) -> LoadedModel:
        """The model, loaded: at start, and again after an idle unload, the same way."""
        return load_model(self.source, dtype=self.dtype, device=self.device, quant=self.args.quant_config(),
                          attention=self.attention, weights_cache=self.args.weights_cache)

    def load_draft_model(self) -> LlamaForCausalLM | None:
        """The draft model (``--draft-model``), loaded as the model is (device, dtype, quantisation,
        attention), or None without one."""
        if self.draft_source is None:
            return None
        return load_model(self.draft_source, dtype=self.dtype, device=self.device, quant=self.args.quant_config(),
                          attention=self.attention, weights_cache=self.args.weights_cache).model

    def reload(self) -> tuple[LlamaForCausalLM, LlamaForCausalLM | None]:
        """The model and the draft model loaded again, the same way (after an idle unload)."""
        return self.load_model().model, self.load_draft_model()

    def load(self) -> Runtime:
        """The model and tokenizer loaded and the engine built over them.

        Raises:
            ValueError: the engine cannot be built (no memory left for the KV pool, a block size the
                kernels lack for this model's head size).
            torch.OutOfMemoryError: the weights do not fit on the GPU.
            LlmdError subclasses: a model llmd cannot read.
        """
        template = None if self.args.chat_template is None else read_chat_template(self.args.chat_template)
        loaded = self.load_model()
        tokenizer = load_tokenizer(self.source)
        if template is not None:
            use_chat_template(tokenizer, template, self.args.chat_template)
        draft = None
        if self.draft_source is not None:
            if load_tokenizer(self.draft_source).get_vocab() != tokenizer.get_vocab():
                raise ValueError(f"the draft model {self.draft_source.name} does not share {self.source.name}'s "
                                 "tokenizer; pick a draft model of the same family")
            draft = self.load_draft_model()
        engine = LLMEngine(loaded.model, tokenizer, self.args.engine_config(),
                           eos_token_ids=stop_token_ids(tokenizer, loaded.config), draft_model=draft)
        return Runtime(engine, tokenizer, self, self.reload)


@dataclass(slots=True)
class Runtime:
    """What :meth:`EngineArgs.build` made: the engine over the loaded model and its tokenizer, what
    they were built from, and ``reload`` (the model and the draft model loaded again the same way: the idle
    unload)."""

    engine: LLMEngine
    tokenizer: Any
    resolved: ResolvedArgs
    reload: Callable[[], tuple[LlamaForCausalLM, LlamaForCausalLM | None]]
