"""Load a model from a :class:`ModelSource`: config, weights (validated) into our implementation."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmd.daemon.attention import AttentionBackend
from llmd.daemon.model_config import ModelConfig, config_from_hf
from llmd.daemon.model_source import ModelSource
from llmd.daemon.models import LlamaForCausalLM
from llmd.daemon.models.llama import head_weight_name
from llmd.daemon.process_memory import release_free_memory
from llmd.daemon.progress import progress
from llmd.daemon.weights.gguf_file import GGUFModelFile
from llmd.daemon.weights.safetensors_files import find_safetensors_files, iter_safetensors, validate_safetensors
from llmd.errors import CorruptModelError, InvalidModelError
from llmd.daemon.quantization import (BNB_SCHEMES, LinearSpec, QuantConfig, calibrated_paths, describe,
                                      gguf_blocks_wanted, linear_factory, plan_linears, prepare, quantize_linears,
                                      weight_memory)
from llmd.daemon.weights import prepared_cache
from llmd.kernels import quant_cpu

log = logging.getLogger("llmd")


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    source: ModelSource


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CorruptModelError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CorruptModelError(f"{path} must hold a JSON object")
    return data


def load_config(source: ModelSource) -> ModelConfig:
    """Read only the config (cheap): for GGUF, the metadata; for a directory, ``config.json``."""
    if source.kind == "gguf":
        return GGUFModelFile(source.path).config()
    config_path = source.path / "config.json"
    if not config_path.is_file():
        raise InvalidModelError(f"{source.path} has no config.json")
    gen_path = source.path / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else None
    return config_from_hf(_read_json(config_path), generation)


def _importance(model: LlamaForCausalLM, source: ModelSource, paths: list[str]) -> dict[str, torch.Tensor]:
    """Calibration for INT4 requantisation (llmd.daemon.calibration); none if there is no tokenizer."""
    from llmd.daemon.tokenizer import load_tokenizer
    from llmd.errors import LlmdError
    from llmd.daemon.calibration import projection_importance
    from llmd.daemon.calibration_text import calibration_ids

    start = time.perf_counter()
    try:
        ids = calibration_ids(load_tokenizer(source))
    except LlmdError as e:
        log.info("requantising to int4 without calibration (%s)", e)
        return {}
    importance = projection_importance(model, ids, paths)
    log.info("int4 calibration: %d tokens of stdlib docstrings through %d projections in %.1fs", len(ids),
             len(paths), time.perf_counter() - start)
    return importance


def _cache_key(source: ModelSource, quant: QuantConfig, dtype: torch.dtype, device: str,
               plan: dict[str, LinearSpec]) -> str | None:
    """The prepared-weights cache's key for this load, None where it cannot be cached: not on the
    CPU, nothing quantised, or no native kernels to hold the layout it maps."""
    if device != "cpu" or not plan or quant_cpu.cpu_path(dtype, quant_cpu.QK) != "native":
        return None
    try:
        return prepared_cache.cache_key(source, quant.scheme, quant.group_size, dtype)
    except OSError:
        return None


def _build(config: ModelConfig, dtype: torch.dtype, attention: AttentionBackend | None,
           plan: dict[str, LinearSpec]) -> LlamaForCausalLM:
    return LlamaForCausalLM(config, dtype=dtype, attn_backend=attention, make_linear=linear_factory(plan))


def _load_cached(source: ModelSource, config: ModelConfig, dtype: torch.dtype, attention: AttentionBackend | None,
                 plan: dict[str, LinearSpec], key: str) -> LlamaForCausalLM | None:
    """The model bound to its prepared-weights cache file, or None where there is none to use."""
    model = _build(config, dtype, attention, plan)
    if not prepared_cache.load(model, prepared_cache.cache_path(key), key):
        return None
    return model.eval()


def _save_and_map(model: LlamaForCausalLM, source: ModelSource, config: ModelConfig, quant: QuantConfig,
                  dtype: torch.dtype, attention: AttentionBackend | None, plan: dict[str, LinearSpec], key: str
                  ) -> LlamaForCausalLM | None:
    """Write ``model``'s prepared weights to the cache and return the model mapping them; None (the
    converted model serves) where it cannot be cached or written."""
    start = time.perf_counter()
    settings = f"--quant {quant.scheme} --group-size {quant.group_size} {str(dtype).removeprefix('torch.')}"
    try:
        path = prepared_cache.save(model, key, source, settings)
    except OSError as e:  # a read-only or full home costs only time
        log.warning("cannot cache the weights in %s: %s", prepared_cache.cache_dir(), e)
        return None
    if path is None:
        return None
    log.info("wrote the prepared weights to %s (%.0f MiB) in %.2fs: later loads map them", path,
             path.stat().st_size / 2**20, time.perf_counter() - start)
    return _load_cached(source, config, dtype, attention, plan, key)


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32, device: str = "cpu",
               quant: QuantConfig | None = None, attention: AttentionBackend | None = None,
               weights_cache: bool = False) -> LoadedModel:
    """Build our model for ``source``, load its weights, held as ``quant`` says (dense if None);
    attention runs on ``attention`` (default: the torch reference). ``weights_cache``: map the
    prepared weights from llmd.daemon.weights.prepared_cache where a load left them, else load,
    leave them there and map them (where the model can be cached: every projection on the native
    kernels).

    Raises:
        LlmdError subclasses for every problem a user can cause (see llmd.errors).
    """
    start = time.perf_counter()
    quant = quant or QuantConfig("none")
    gguf_types = None
    if source.kind == "gguf":
        gguf = GGUFModelFile(source.path)
        config = gguf.config()
        gguf.check_tensor_types()
        gguf_types = gguf.tensor_types()
    else:
        config = load_config(source)
        files = find_safetensors_files(source.path)
    try:
        plan = plan_linears(config, quant, device, gguf_types)
    except ValueError as e:
        raise InvalidModelError(f"cannot quantise {source.name} with --quant {quant.scheme}: {e}") from None
    blocks = gguf_blocks_wanted(plan, gguf_types) if gguf_types is not None else set()
    head_name = head_weight_name(config)
    if gguf_types is not None and gguf_types.get(head_name) == "Q8_0" and quant.scheme != "none":
        blocks.add(head_name)  # kept as blocks for the Q8 head kernel (LlamaForCausalLM.prepare_head)
    # INT4 projections that are requantised are loaded dense, then fitted with calibration.
    calibrated = calibrated_paths(plan, blocks)
    if gguf_types is not None:
        weights, total = gguf.iter_tensors(config, blocks), gguf.num_tensors
    else:
        total = sum(len(validate_safetensors(f)) for f in files)
        weights = iter_safetensors(files)
    key = _cache_key(source, quant, dtype, device, plan) if weights_cache else None
    if key is not None and (model := _load_cached(source, config, dtype, attention, plan, key)) is not None:
        return _loaded(model, config, source, start, f", mapping {prepared_cache.cache_path(key)}")
    streamed = {path: spec for path, spec in plan.items() if path not in calibrated}
    with torch.device(device):
        model = LlamaForCausalLM(config, dtype=dtype, attn_backend=attention, make_linear=linear_factory(streamed))
    model.load_weights(progress(weights, total, f"loading {source.name}"))
    try:
        if calibrated:
            quantize_linears(model, quant, plan, _importance(model, source, calibrated))
        elif quant.scheme in BNB_SCHEMES:
            quantize_linears(model, quant)
    except ValueError as e:
        raise InvalidModelError(f"cannot quantise {source.name} with --quant {quant.scheme}: {e}") from None
    prepare(model)
    model.eval()
    if key is not None:  # cached and mapped: the converted copy goes, the file's pages serve as at later loads
        model = _save_and_map(model, source, config, quant, dtype, attention, plan, key) or model
    release_free_memory()  # the tensors' intermediate forms, freed into the heap: back to the system
    return _loaded(model, config, source, start, "")


def _loaded(model: LlamaForCausalLM, config: ModelConfig, source: ModelSource, start: float, how: str
            ) -> LoadedModel:
    log.info("loaded %s (%s, %d layers) in %.2fs%s; weights: %s; kernels: %s", source.name, config.model_type,
             config.num_layers, time.perf_counter() - start, how, describe(weight_memory(model)),
             ", ".join(f"{k} {v}" for k, v in model.kernels().items()))
    return LoadedModel(model=model, config=config, source=source)
