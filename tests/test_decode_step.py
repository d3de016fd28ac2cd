"""The native decode step (kernels/cpu/decode_step.c): every decoder layer of a pure decode step in
one call. Against the per-layer path of the same model (same quantised weights, same activation
quantisation in the matmuls): the next-token distributions must agree far closer than any bug
(a wrong slot, RoPE angle, bias or norm) would leave them, on every architecture feature, in
both builds of the library, fp32 and bf16 KV caches."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from tiny_models import make_hf_model, save_hf_model

from llmd.daemon.attention import CpuAttentionBackend
from llmd.daemon.reference_generator import Generator
from llmd.daemon.loader import load_model
from llmd.daemon.model_source import resolve_model
from llmd.kernels import native
from llmd.daemon.quantization import QuantConfig

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")

# rope scaling, qkv bias, q/k norms with head_dim 32, sliding window 16, GQA 8:1
ARCHS = ["llama", "llama3", "qwen2", "qwen3", "mistral", "tinyllama"]


@pytest.fixture(scope="module", params=["native-arch", "portable"])
def lib(request) -> ctypes.CDLL:
    if request.param == "native-arch":
        return native.library()
    return native.load(native.build(portable=True))  # (cached with the other builds: conftest.py)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decode")
    return {name: save_hf_model(make_hf_model(name, max_position_embeddings=512), root / name, with_tokenizer=True)
            for name in ARCHS}


def load(model_dir: Path, dtype: torch.dtype, quant: str = "int4"):
    return load_model(resolve_model(model_dir), dtype=dtype, quant=QuantConfig(quant),
                      attention=CpuAttentionBackend()).model


def decode_logits(model, ids: list[int], prompt: int) -> torch.Tensor:
    """``ids[:prompt]`` in one forward (the per-layer path), then one token per step, teacher-forced:
    the log-probabilities after each decoded token."""
    return torch.log_softmax(Generator(model).step_logits(ids[:prompt], ids[prompt:])[1:].float(), dim=-1)


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    return (p_log.exp() * (p_log - q_log)).sum(-1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_matches_the_per_layer_path(lib, model_dirs, arch: str, dtype: torch.dtype) -> None:
    """200 decode steps after a 100-token prompt (contexts past the window and several KV blocks),
    against the per-layer path of the same model with the same int4 weights. fp32: mean KL
    measured < 2e-5. bf16: the step keeps its residual stream in fp32 where the per-layer path
    rounds it to bf16, so both are held to the fp32 model: the step may not be further from it
    than the per-layer bf16 path is (measured: 0.02-0.06 each for these random models, whose
    activations bf16 rounds hard). A bug moves the mean by 0.1 or more (test_a_bug_would_show)."""
    g = torch.Generator().manual_seed(len(arch))
    ids = torch.randint(0, 272, (300,), generator=g).tolist()
    model = load(model_dirs[arch], dtype)
    model.prepare_decode(lib)
    assert model.decode_step is not None
    got = decode_logits(model, ids, 100)
    reference = load(model_dirs[arch], torch.float32)
    reference.decode_step = None
    want = decode_logits(reference, ids, 100)
    divergence = kl(want, got)
    if dtype == torch.float32:
        assert divergence.mean() < 1e-4 and divergence.max() < 2e-3, (divergence.mean(), divergence.max())
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95
    else:
        model.decode_step = None
        per_layer = kl(want, decode_logits(model, ids, 100))
        assert divergence.mean() < 1.2 * per_layer.mean() + 1e-3, (divergence.mean(), per_layer.mean())


def test_a_bug_would_show(model_dirs) -> None:
    """The canary of the bounds above: the same comparison with one layer's RoPE skipped in the
    reference (positions off for one layer) diverges by orders of magnitude more."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 272, (300,), generator=g).tolist()
    model = load(model_dirs["llama"], torch.float32)
    got = decode_logits(model, ids, 100)
    reference = load(model_dirs["llama"], torch.float32)
    reference.decode_step = None
    attn = reference.model.layers[1].self_attn
    attn.scale = attn.scale * 0.5  # a wrong softmax temperature in one layer
    divergence = kl(decode_logits(reference, ids, 100), got)
    assert divergence.mean() > 100 * 1e-4


def test_models_the_step_cannot_take_keep_the_per_layer_path(model_dirs, monkeypatch) -> None:
    assert load(model_dirs["llama"], torch.float32, quant="none").decode_step is None  # dense projections
    torch_backend = load_model(resolve_model(model_dirs["llama"]), quant=QuantConfig("int4")).model
    assert torch_backend.decode_step is None  # the reference attention backend: the reference path
    monkeypatch.setenv("LLMD_FUSED_DECODE", "0")
    assert load(model_dirs["llama"], torch.float32).decode_step is None


def test_decode_rows_take_the_step_whatever_shares_it(model_dirs) -> None:
    """A sequence's decoded tokens do not depend on whether another request's prompt chunks share
    its steps: with the step's fp32 residual stream against the layers' bf16 one, a decode row
    in a mixed step must take the decode step too. Exactly the same log-probabilities."""
    from llmd.daemon.engine.engine import EngineConfig, LLMEngine
    from llmd.daemon.engine.sampling_params import SamplingParams
    from llmd.daemon.tokenizer import load_tokenizer

    model = load(model_dirs["llama"], torch.bfloat16)
    tokenizer = load_tokenizer(resolve_model(model_dirs["llama"]))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    g = torch.Generator().manual_seed(5)
    prompt_a, prompt_b = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 45))

    def logprobs_of_a(with_b: bool) -> list[float]:
        engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=64, max_batched_tokens=16))
        engine.add_request("a", prompt_a, params)
        got, step = [], 0
        while engine.has_unfinished():
            if with_b and step == 3:  # a is decoding: b's prompt chunks now share its steps
                engine.add_request("b", prompt_b, params)
            got += [lp[0] for d in engine.step() if d.request_id == "a" for lp in d.logprobs]
            step += 1
        return got

    assert logprobs_of_a(with_b=True) == logprobs_of_a(with_b=False)
