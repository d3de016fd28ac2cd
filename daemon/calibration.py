"""Calibration for INT4 requantisation: which input features of each projection carry signal.

Requantising to INT4 (a float checkpoint, or GGUF blocks into coarser groups) fits each group's
scale and min to minimise the error weighted by the mean squared activation of each input feature
(:func:`llmd.quant.int4_fit.quantize_int4_fitted`, as llama.cpp's importance matrix). The
activations come from one forward pass over a fixed text every machine has: the docstrings of a
list of standard-library modules (llmd.daemon.calibration_text). That list is disjoint from the text
``benchmarks/quant_quality.py`` measures perplexity on, so the gate is not measured on its own
calibration data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


@torch.inference_mode()
def projection_importance(model: nn.Module, token_ids: list[int], paths: Sequence[str]) -> dict[str, torch.Tensor]:
    """``{module path: [in_features]}`` mean squared input of each projection in ``paths`` over one
    forward pass of ``token_ids`` through the (dense) ``model``."""
    from llmd.daemon.reference_generator import Generator
    from llmd.quant.int4_fit import input_importance

    modules = {model.get_submodule(p): p for p in paths}
    gen, window = Generator(model), model.config.max_position_embeddings

    def run() -> None:
        for start in range(0, len(token_ids), window):  # windows, for models with a short context
            gen.logits(token_ids[start:start + window])

    sums = input_importance(list(modules), run)
    return {modules[m]: v.float() for m, v in sums.items()}
