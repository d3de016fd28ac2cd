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
from llmd.daemon.quantization import (BNB_SCHEMES, QuantConfig, calibrated_paths, describe, gguf_blocks_wanted,
                              linear_factory, plan_linears, prepare, quantize_linears, weight_memory)

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


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32, device: str = "cpu",
               quant: QuantConfig | None = None, attention: AttentionBackend | None = None) -> LoadedModel:
    """Build our model for ``source``, load its weights, held as ``quant`` says (dense if None);
    attention runs on ``attention`` (default: the torch reference).

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
    release_free_memory()  # the tensors' intermediate forms, freed into the heap: back to the system
    log.info("loaded %s (%s, %d layers) in %.1fs; weights: %s; kernels: %s", source.name, config.model_type,
             config.num_layers, time.perf_counter() - start, describe(weight_memory(model)),
             ", ".join(f"{k} {v}" for k, v in model.kernels().items()))
    return LoadedModel(model=model, config=config, source=source)
