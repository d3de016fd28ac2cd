"""`--quant`: which format each projection gets, that a quantised model computes exactly what a dense
model over the dequantised weights computes, that GGUF blocks are kept as they are, and what the
weights take."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_models import make_hf_model, save_hf_model, write_llama_gguf

from llmd.cli import main
from llmd.config import GROUPLESS_QUANT
from llmd.daemon.reference_generator import Generator
from llmd.daemon.loader import load_model
from llmd.daemon.model_source import resolve_model
from llmd.daemon.weights.gguf_file import hf_name, unpermute_qk
from llmd.daemon.quantization import PROJECTIONS, QuantConfig, weight_memory
from llmd.quant.gguf_import import import_q4_0, import_q8_0
from llmd.quant.bnb import BNB_SCHEMES
from llmd.quant.int4 import Int4Linear, dequantize_int4
from llmd.quant.int8 import Int8Linear, dequantize_int8


@pytest.fixture(autouse=True)
def reference_matmuls(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the weights each format holds, so they compare exact arithmetic: the
    reference matmul (dequantise, multiply). The native kernels, which also quantise activations,
    have their own tests (test_native_cpu_kernels.py)."""
    monkeypatch.setenv("LLMD_NATIVE", "0")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(make_hf_model("qwen2"), tmp_path_factory.mktemp("q") / "m", with_tokenizer=True)


def projections(model) -> list:
    return [layer.get_submodule(p) for layer in model.model.layers for p in PROJECTIONS]


def dequantised_dense_copy(quantised, source):
    """A dense model whose projections hold ``quantised``'s dequantised weights."""
    dense = load_model(source).model
    for q, d in zip(projections(quantised), projections(dense)):
        w = dequantize_int4(q.weight()) if isinstance(q, Int4Linear) else dequantize_int8(q.weight())
        d.weight.data.copy_(w)
    return dense


@pytest.mark.parametrize("scheme,group_size,cls", [("int8", None, Int8Linear), ("int8", 32, Int8Linear),
                                                   ("int4", 32, Int4Linear), ("int4", 64, Int4Linear),
                                                   ("auto", None, Int4Linear)])
def test_quantised_model_equals_dense_model_over_dequantised_weights(model_dir, scheme, group_size, cls) -> None:
    source = resolve_model(model_dir)
    quantised = load_model(source, quant=QuantConfig(scheme, group_size)).model
    assert all(isinstance(p, cls) for p in projections(quantised))
    assert all(p.group_size == (group_size or (32 if cls is Int4Linear else p.in_features))
               for p in projections(quantised))
    dense = dequantised_dense_copy(quantised, source)
    ids = list(range(3, 40))
    assert torch.allclose(Generator(quantised).logits(ids), Generator(dense).logits(ids), atol=1e-4)
    # ...and it is not the dense model itself: quantisation changed the weights.
    assert not torch.allclose(Generator(load_model(source).model).logits(ids), Generator(dense).logits(ids),
                              atol=1e-4)


def test_int4_weights_take_a_fifth_of_fp32(model_dir) -> None:
    quantised = load_model(resolve_model(model_dir), quant=QuantConfig("int4")).model
    memory = weight_memory(quantised)
    fp32 = sum(4 * m.in_features * m.out_features for m in projections(quantised))
    assert set(memory) == {"int4 g32", "dense float32"}
    assert memory["int4 g32"] <= 0.2 * fp32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_blocks_are_kept_as_they_are(tmp_path: Path, dtype: torch.dtype, caplog) -> None:
    """A GGUF mixing Q4_0, Q8_0 and Q5_0 projections: auto copies the Q4_0 and Q8_0 blocks bit for bit
    (q/k rows un-permuted), requantises Q5_0 (with a log line), and computes what the dense model
    over those weights computes."""
    hf = make_hf_model("llama")
    path = write_llama_gguf(hf, tmp_path / "m.gguf", "Q4_0",
                            per_module={"self_attn.o_proj": "Q8_0", "mlp.down_proj": "Q5_0"})
    source = resolve_model(path)
    with caplog.at_level(logging.INFO, logger="llmd"):
        quantised = load_model(source, quant=QuantConfig("auto")).model
    assert "GGUF Q5_0 tensors are dequantised and requantised to int8 per channel" in caplog.text
    layer = quantised.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear) and layer.self_attn.qkv_proj.symmetric
    assert isinstance(layer.self_attn.o_proj, Int8Linear) and layer.self_attn.o_proj.group_size == 32
    assert isinstance(layer.mlp.down_proj, Int8Linear) and layer.mlp.down_proj.group_size == hf.config.intermediate_size
    cfg = quantised.config
    tensors = {hf_name(t.name): t for t in gguf.GGUFReader(str(path)).tensors}
    q = import_q4_0(np.asarray(tensors["model.layers.0.self_attn.q_proj.weight"].data))
    qkv = layer.self_attn.qkv_proj
    assert torch.equal(qkv.packed[:cfg.q_size], unpermute_qk(q.packed, cfg.num_heads))
    assert torch.equal(qkv.scales[:cfg.q_size], unpermute_qk(q.scales, cfg.num_heads))
    o = import_q8_0(np.asarray(tensors["model.layers.0.self_attn.o_proj.weight"].data))
    assert torch.equal(layer.self_attn.o_proj.qweight, o.qweight) and torch.equal(layer.self_attn.o_proj.scales, o.scales)

    # The dense model over the GGUF's own dequantisation, except for the requantised down_proj.
    dense = load_model(source).model
    for qp, dp in zip(projections(quantised), projections(dense)):
        if isinstance(qp, Int8Linear) and qp.group_size != 32:
            dp.weight.data.copy_(dequantize_int8(qp.weight()))
    ids = list(range(3, 40))
    assert torch.allclose(Generator(quantised).logits(ids), Generator(dense).logits(ids), atol=1e-4)

    if dtype == torch.bfloat16:  # the CPU kernels' layouts: one copy held, same answers within bf16
        quantised_bf16 = load_model(source, dtype=dtype, quant=QuantConfig("auto")).model
        a = Generator(quantised_bf16).logits(ids).float()
        b = Generator(dense).logits(ids)
        assert (a - b).abs().max() < 0.1 * b.abs().max()
        assert weight_memory(quantised_bf16)["int4 g32"] <= weight_memory(quantised)["int4 g32"] * 1.1


def test_explicit_int4_on_a_q4_0_gguf_copies_without_requantising(tmp_path: Path) -> None:
    hf = make_hf_model("llama")
    source = resolve_model(write_llama_gguf(hf, tmp_path / "m.gguf", "Q4_0"))
    auto = load_model(source, quant=QuantConfig("auto")).model
    explicit = load_model(source, quant=QuantConfig("int4", 32)).model
    for a, b in zip(projections(auto), projections(explicit)):
        assert torch.equal(a.packed, b.packed) and torch.equal(a.scales, b.scales) and torch.equal(a.mins, b.mins)
    coarser = load_model(source, quant=QuantConfig("int4", 64)).model  # requantised from the blocks
    assert all(p.group_size == 64 for p in projections(coarser))


def test_none_keeps_dense_weights(model_dir) -> None:
    model = load_model(resolve_model(model_dir), quant=QuantConfig("none")).model
    assert set(weight_memory(model)) == {"dense float32"}


def test_group_sizes_fall_back_where_they_do_not_divide(model_dir, tmp_path: Path, caplog, capsys) -> None:
    # The tiny model's hidden size is 64: groups of 128 fall back to 64 there, and stay 128 for
    # down_proj (input 128).
    with caplog.at_level(logging.INFO, logger="llmd"):
        model = load_model(resolve_model(model_dir), quant=QuantConfig("int4", 128)).model
    assert "group size 128 does not divide the input size 64 of some projections: they use group size 64" in caplog.text
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.group_size == 64 and layer.mlp.down_proj.group_size == 128
    # Hidden size 48: no int4 group divides it. auto holds those projections as int8 per channel;
    # an explicit int4 is a one-line error.
    odd = save_hf_model(make_hf_model("smollm2"), tmp_path / "odd", with_tokenizer=True)
    auto = load_model(resolve_model(odd), quant=QuantConfig("auto")).model
    assert isinstance(auto.model.layers[0].self_attn.qkv_proj, Int8Linear)
    assert isinstance(auto.model.layers[0].mlp.down_proj, Int4Linear)  # its input is 128
    assert main(["generate", "hi", "--model", str(odd), "--quant", "int4", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert "llmd: error: cannot quantise" in err and "group size 32 must divide the input dimension 48" in err
    assert "Traceback" not in err


def test_bad_quant_options_are_one_line_errors(model_dir, capsys) -> None:
    assert main(["generate", "hi", "--model", str(model_dir), "--quant", "int4", "--max-tokens", "4",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip() != ""
    assert main(["generate", "hi", "--model", str(model_dir), "--quant", "none", "--group-size", "32"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llmd: error:") and "--group-size does not apply" in err
    with pytest.raises(ValueError, match="quantisation must be one of"):
        QuantConfig("int3")
    # the CLI checks the pair without the runtime (llmd.config): the same schemes as the runtime's
    for scheme in ("none", *BNB_SCHEMES):
        with pytest.raises(ValueError, match="does not apply"):
            QuantConfig(scheme, 64)
    assert set(GROUPLESS_QUANT) == {"none", *BNB_SCHEMES}
