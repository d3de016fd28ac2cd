"""`--quant nf4|bnb-int8`: bitsandbytes' modules compute the projection within their format's error,
hold the bytes the format promises, refuse clearly what they cannot run, and a whole model
generates with them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_engine, make_hf_model, run_engine, save_hf_model

from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.reference_generator import Generator
from llmd.daemon.loader import load_model
from llmd.daemon.model_source import resolve_model
from llmd.quant import bnb
from llmd.daemon.quantization import PROJECTIONS, QuantConfig, quantize_linears
from llmd.quant.bnb import bnb_linear, bnb_unsupported_reason, bnb_weight_bytes

# Relative error of y = x W^T + b against the dense product, for random Gaussian W and x: NF4's
# 16 levels per block of 64 are off by ~9%, LLM.int8 by ~1%. A wrong or transposed weight is off
# by ~140%.
TOLERANCE = {"nf4": 0.13, "bnb-int8": 0.025}


def _rel(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / scale.norm()).item()


@pytest.mark.parametrize("scheme", ["nf4", "bnb-int8"])
def test_bitsandbytes_runs_both_schemes_on_the_cpu(scheme) -> None:
    assert bnb_unsupported_reason(scheme, "cpu") is None


# (128, 128): square, so a transposed weight would still run; (48, 128): an output size that the
# AVX512-BF16 NF4 kernel cannot take, which must fall back to bitsandbytes' generic path.
@pytest.mark.parametrize("shape", [(128, 128), (48, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["nf4", "bnb-int8"])
def test_module_computes_the_dense_product_within_the_format_error(scheme, dtype, shape) -> None:
    n, k = shape
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    b = 0.5 * k**0.5 * torch.randn(n, generator=g)  # as large as x W^T: a dropped bias shows
    module = bnb_linear(w, b, scheme, compute_dtype=dtype, device="cpu")
    held = bnb_weight_bytes(module)
    for t in (1, 7):  # a decode step and a prefill chunk
        x = torch.randn(t, k, generator=g).to(dtype)
        with torch.inference_mode():
            y = module(x)
        assert y.dtype == dtype and y.shape == (t, n)
        xw = x.float() @ w.T
        assert _rel(y, xw + b, xw) < TOLERANCE[scheme]
        if n == k:  # the check tells a transposed weight apart
            assert _rel(y, x.float() @ w + b, xw) > 1.0
        assert torch.equal(module(x), y)
    assert bnb_weight_bytes(module) == held  # nothing is converted on use any more
    if scheme == "nf4":  # 4-bit codes + one absmax (fp32, or bf16 once packed for the CPU) per 64
        assert n * k / 2 < held <= n * k * (0.5 + 4 / 64) + 64
    else:  # int8 codes + one fp32 scale per row
        assert held == n * k + 4 * n


def test_nf4_needs_input_sizes_divisible_by_its_block_size() -> None:
    with pytest.raises(ValueError, match="multiples of 64 .* got 48; use --quant int4"):
        bnb_linear(torch.randn(64, 48), None, "nf4", torch.float32, "cpu")


@pytest.fixture
def fresh_reasons():
    bnb._reason.cache_clear()
    yield
    bnb._reason.cache_clear()


def test_a_backend_that_fails_is_refused_with_the_reason(fresh_reasons, monkeypatch) -> None:
    def no_backend(scheme: str, device: str) -> float:
        raise NotImplementedError(f"no kernel for {scheme} on {device}\nstack details")

    monkeypatch.setattr(bnb, "_probe", no_backend)
    reason = bnb_unsupported_reason("nf4", "cpu")
    assert reason == (f"bitsandbytes {bnb._import_bnb().__version__} cannot run NF4 on cpu "
                      "(NotImplementedError: no kernel for nf4 on cpu); use --quant int4 or int8 "
                      "(llmd's own formats) instead")
    with pytest.raises(ValueError) as e:
        bnb_linear(torch.randn(64, 64), None, "nf4", torch.float32, "cpu")
    assert str(e.value) == reason


def test_a_backend_that_computes_garbage_is_refused(fresh_reasons, monkeypatch) -> None:
    monkeypatch.setattr(bnb, "_probe", lambda scheme, device: 1.4)
    with pytest.raises(ValueError, match=r"computes LLM.int8 wrongly on cpu \(off by 140%\); use --quant int4"):
        bnb_linear(torch.randn(64, 64), None, "bnb-int8", torch.float32, "cpu")


def test_missing_bitsandbytes_is_refused(fresh_reasons, monkeypatch) -> None:
    def not_installed():
        raise ImportError("No module named 'bitsandbytes'")

    monkeypatch.setattr(bnb, "_import_bnb", not_installed)
    assert bnb_unsupported_reason("bnb-int8", "cpu").startswith("bitsandbytes is not installed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="NF4 on cuda needs a CUDA GPU"):
        bnb_linear(torch.randn(64, 64), None, "nf4", torch.float32, "cuda")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # qwen2: qkv bias; input sizes 64 and 128 (NF4 blocks of 64 divide them).
    return save_hf_model(make_hf_model("qwen2"), tmp_path_factory.mktemp("bnb") / "m", with_tokenizer=True)


PROMPT = torch.randint(0, 259, (40,), generator=torch.Generator().manual_seed(1)).tolist()


def _dense_with_nf4_weights(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The dense model with each projection's weight replaced by its NF4 round trip."""
    import bitsandbytes.functional as BF

    model = load_model(resolve_model(model_dir), dtype=dtype, quant=QuantConfig("none")).model
    for layer in model.model.layers:
        for path in PROJECTIONS:
            parent, name = path.split(".")
            weight = getattr(getattr(layer, parent), name).weight.data
            q, state = BF.quantize_4bit(weight.float(), blocksize=64, compress_statistics=False, quant_type="nf4")
            weight.copy_(BF.dequantize_4bit(q, state))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["nf4", "bnb-int8"])
def test_quantised_model_logits_follow_the_dense_model(model_dir, scheme, dtype) -> None:
    source = resolve_model(model_dir)
    model = load_model(source, dtype=dtype, quant=QuantConfig("none")).model
    quantize_linears(model, QuantConfig(scheme))
    assert sum(getattr(m, "quant_scheme", None) == scheme for m in model.modules()) == 4 * len(model.model.layers)
    got = Generator(model).logits(PROMPT).float()  # row i: the first-token logits of PROMPT[:i + 1]
    dense = Generator(load_model(source, dtype=dtype, quant=QuantConfig("none")).model).logits(PROMPT).float()
    cos = F.cosine_similarity(got, dense, dim=-1)
    top1 = (got.argmax(-1) == dense.argmax(-1)).float().mean()
    # A shuffled or transposed projection gives cosines around 0 and top-1 agreement under 5%.
    if scheme == "bnb-int8":  # observed: cosine >= 0.985, top-1 >= 88%
        assert cos.min() > 0.97 and top1 >= 0.8
    else:
        # 4-bit weights move this tiny random model a lot (llmd's int4 g32 too: mean cosine 0.91,
        # top-1 50%); observed here 0.88 and 47%. The tight check is against the dense model over
        # the NF4-rounded weights, which differs only by the CPU kernel computing in bf16.
        assert cos.mean() > 0.8
        rounded = Generator(_dense_with_nf4_weights(model_dir, dtype)).logits(PROMPT).float()
        cos = F.cosine_similarity(got, rounded, dim=-1)
        top1 = (got.argmax(-1) == rounded.argmax(-1)).float().mean()
        assert cos.min() > 0.99 and top1 >= 0.85  # observed: >= 0.998 and 93%


@pytest.mark.parametrize("scheme", ["nf4", "bnb-int8"])
def test_engine_generates_greedily_with_bitsandbytes_projections(model_dir, scheme) -> None:
    engine = make_engine(model_dir, num_blocks=16)
    quantize_linears(engine.model, QuantConfig(scheme))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # "b" arrives while "a" decodes: from then on they share each step's flat batch.
    out = run_engine(engine, [(0, "a", PROMPT, params), (1, "b", PROMPT[:9], params)])
    assert len(out["a"]) == len(out["b"]) == 8
    gen = Generator(engine.model)
    assert out["a"][0] == gen.logits(PROMPT)[-1].argmax().item()  # a's prefill ran alone
    if scheme == "nf4":  # NF4 computes each row on its own: batching changes nothing
        assert out == {"a": list(gen.stream(PROMPT, params)), "b": list(gen.stream(PROMPT[:9], params))}
    # LLM.int8 picks its fp16 outlier columns over the whole batch, so a sequence's logits move
    # (slightly) with its batch-mates and greedy ties can flip: no token-for-token check.
