"""GGUF loading: tiny llama.cpp-style files against transformers, and the default model against
transformers' own GGUF loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import hf_greedy, make_hf_model, write_llama_gguf

from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.reference_generator import Generator
from llmd.daemon.loader import load_model
from llmd.daemon.model_source import ModelSource, resolve_model
from llmd.daemon.tokenizer import encode_prompt, load_tokenizer, stop_token_ids
from llmd.daemon.weights.gguf_file import unpermute_qk


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(8 * 2 * 3, dtype=np.float32).reshape(8 * 2, 3)  # 2 heads of dim 8
    permuted = w.reshape(2, 2, 4, 3).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, 2), w)


@pytest.mark.parametrize("name", ["llama", "tinyllama", "smollm2"])
def test_tiny_gguf_matches_transformers(name: str, tmp_path: Path) -> None:
    hf = make_hf_model(name)
    path = write_llama_gguf(hf, tmp_path / f"{name}.gguf")
    ours = load_model(resolve_model(path))
    assert ours.config.tie_word_embeddings == hf.config.tie_word_embeddings
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = Generator(ours.model).logits(ids)
    assert (got - ref).abs().max().item() < 1e-4
    assert list(Generator(ours.model).stream(ids, SamplingParams(max_tokens=16, temperature=0))) == \
        hf_greedy(hf, ids, 16)


def test_tiny_gguf_q8_0_dequantises_close(tmp_path: Path) -> None:
    hf = make_hf_model("llama")
    ours = load_model(resolve_model(write_llama_gguf(hf, tmp_path / "q8.gguf", quantize_type="Q8_0")))
    for hf_layer, our_layer in zip(hf.model.layers, ours.model.model.layers):
        q_ref = hf_layer.self_attn.q_proj.weight
        q_got = our_layer.self_attn.qkv_proj.weight[: q_ref.shape[0]]
        # Q8_0 keeps 8 bits per value with one scale per 32: error below half a step of the scale.
        bound = q_ref.abs().max().item() / 127
        assert (q_got - q_ref).abs().max().item() <= bound


# The default model: real weights, real tokenizer, transformers' GGUF loader as the reference.
PROMPTS = [
    ("chat", "What is the capital of France?"),
    ("raw", "The three primary colours are"),
    ("chat", "Write a Python function that reverses a string."),
]


@pytest.fixture(scope="module")
def default_pair(default_model_path: Path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
    ).eval()
    source = ModelSource("gguf", default_model_path, "default")
    return ref, load_model(source), load_tokenizer(source)


@pytest.mark.slow
@pytest.mark.parametrize("mode,prompt", PROMPTS)
def test_default_model_greedy_matches_transformers(default_pair, mode: str, prompt: str) -> None:
    ref, ours, tokenizer = default_pair
    ids = encode_prompt(tokenizer, prompt, chat=mode == "chat")
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0]
    assert (Generator(ours.model).logits(ids) - ref_logits).abs().max().item() < 1e-3
    expected = hf_greedy(ref, ids, 32)
    got = list(Generator(ours.model).stream(ids, SamplingParams(max_tokens=32, temperature=0)))
    assert got == expected, f"{tokenizer.decode(got)!r} != {tokenizer.decode(expected)!r}"


@pytest.mark.slow
def test_default_model_answers_paris(default_pair) -> None:
    _, ours, tokenizer = default_pair
    ids = encode_prompt(tokenizer, "What is the capital of France?")
    stops = stop_token_ids(tokenizer, ours.config)
    assert tokenizer.convert_ids_to_tokens(sorted(stops)) == ["<|im_end|>"]
    out = list(Generator(ours.model).stream(ids, SamplingParams(max_tokens=32, temperature=0), stops))
    assert out[-1] in stops
    assert "Paris" in tokenizer.decode(out, skip_special_tokens=True)
