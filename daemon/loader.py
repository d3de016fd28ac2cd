"""Load a model from a :class:`ModelSource`: config, weights (validated) into our implementation."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmd.daemon.config import ModelConfig, config_from_hf
from llmd.daemon.model_source import ModelSource
from llmd.daemon.models import LlamaForCausalLM
from llmd.daemon.progress import progress
from llmd.daemon.weights.gguf_file import GGUFModelFile
from llmd.daemon.weights.safetensors_files import find_safetensors_files, iter_safetensors, validate_safetensors
from llmd.errors import CorruptModelError, InvalidModelError
from llmd.quant.apply import QuantConfig, quantize_linears

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


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32, device: str = "cpu",
               quant: QuantConfig | None = None) -> LoadedModel:
    """Build our model for ``source``, load its weights and quantise it if ``quant`` says so.

    Raises:
        LlmdError subclasses for every problem a user can cause (see llmd.errors).
    """
    start = time.perf_counter()
    if source.kind == "gguf":
        gguf = GGUFModelFile(source.path)
        config = gguf.config()
        gguf.check_tensor_types()
        weights, total = gguf.iter_tensors(config), gguf.num_tensors
    else:
        config = load_config(source)
        files = find_safetensors_files(source.path)
        total = sum(len(validate_safetensors(f)) for f in files)
        weights = iter_safetensors(files)
    with torch.device(device):
        model = LlamaForCausalLM(config, dtype=dtype)
    model.load_weights(progress(weights, total, f"loading {source.name}"))
    if quant is not None and quant.scheme != "none":
        try:
            quantize_linears(model, quant)
        except ValueError as e:
            raise InvalidModelError(f"cannot quantise {source.name} as {quant.describe()}: {e}") from None
    model.eval()
    log.info("loaded %s (%s, %d layers) in %.1fs", source.name, config.model_type, config.num_layers,
             time.perf_counter() - start)
    return LoadedModel(model=model, config=config, source=source)
