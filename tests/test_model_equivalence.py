"""Our Llama-family implementation against transformers on tiny random models (fp32).

For every supported architecture: logits within 1e-4 on prompts of 1, 7 and 64 tokens, and 32
greedy tokens identical to transformers' own ``generate``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import TINY_CONFIGS, hf_greedy, make_hf_model, save_hf_model

from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.reference_generator import Generator
from llmd.daemon.loader import load_model
from llmd.daemon.model_source import resolve_model


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    hf = make_hf_model(name)
    path = save_hf_model(hf, tmp_path_factory.mktemp(name))
    return name, hf, load_model(resolve_model(path))


@pytest.mark.parametrize("length", [1, 7, 64])
def test_logits_match_transformers(pair, length: int) -> None:
    name, hf, ours = pair
    ids = torch.randint(0, hf.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = Generator(ours.model).logits(ids)
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item()
    assert err < 1e-4, f"{name}: max |logit diff| {err:.2e} at length {length}"


def test_greedy_32_tokens_match_generate(pair) -> None:
    name, hf, ours = pair
    for seed in range(2):
        ids = torch.randint(0, hf.config.vocab_size, (7 + 20 * seed,),
                            generator=torch.Generator().manual_seed(100 + seed)).tolist()
        expected = hf_greedy(hf, ids, 32)
        got = list(Generator(ours.model).stream(ids, SamplingParams(max_tokens=32, temperature=0)))
        assert got == expected, f"{name}: greedy tokens differ"


def test_features_reach_our_config(pair) -> None:
    """The architecture-specific features really are exercised by the tiny models above."""
    name, _, ours = pair
    cfg = ours.config
    expected = {
        "llama3": lambda: cfg.rope.rope_type == "llama3",
        "mistral": lambda: cfg.sliding_windows == (16, 16),
        "qwen2": lambda: cfg.qkv_bias and cfg.tie_word_embeddings and not cfg.o_proj_bias,
        "qwen3": lambda: cfg.qk_norm and cfg.head_dim == 32,
        "smollm2": lambda: cfg.tie_word_embeddings and cfg.num_heads // cfg.num_kv_heads == 3,
        "tinyllama": lambda: cfg.num_heads // cfg.num_kv_heads == 8,
        "llama": lambda: not cfg.tie_word_embeddings and cfg.rope.rope_type == "default",
    }[name]
    assert expected()


def test_sliding_window_matters(tmp_path: Path) -> None:
    """Guard against the Mistral case passing vacuously: without the window, logits change."""
    hf = make_hf_model("mistral")
    ours = load_model(resolve_model(save_hf_model(hf, tmp_path / "m")))
    ids = list(range(1, 65))
    windowed = Generator(ours.model).logits(ids)
    for layer in ours.model.model.layers:
        layer.self_attn.sliding_window = None
    full = Generator(ours.model).logits(ids)
    assert (windowed[:16] - full[:16]).abs().max() < 1e-5  # inside the window nothing changes
    assert (windowed[32:] - full[32:]).abs().max() > 1e-3
