"""`--quant int8|int4`: the projections are replaced, the model computes exactly what a dense model
over the dequantised weights computes, and the weights shrink."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_hf_model, save_hf_model

from llmd.cli import main
from llmd.daemon.generate import Generator
from llmd.daemon.loader import load_model
from llmd.daemon.model_source import resolve_model
from llmd.quant.apply import QuantConfig, weight_bytes
from llmd.quant.int4 import Int4Linear, dequantize_int4
from llmd.quant.int8 import Int8Linear, dequantize_int8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(make_hf_model("qwen2"), tmp_path_factory.mktemp("q") / "m", with_tokenizer=True)


@pytest.mark.parametrize("scheme,group_size,cls", [("int8", None, Int8Linear), ("int8", 32, Int8Linear),
                                                   ("int4", 32, Int4Linear), ("int4", 64, Int4Linear)])
def test_quantised_model_equals_dense_model_over_dequantised_weights(model_dir, scheme, group_size, cls) -> None:
    source = resolve_model(model_dir)
    quantised = load_model(source, quant=QuantConfig(scheme, group_size)).model
    dense = load_model(source).model
    for ql, dl in zip(quantised.model.layers, dense.model.layers):
        for parent, name in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                             ("mlp", "down_proj")):
            q = getattr(getattr(ql, parent), name)
            assert isinstance(q, cls)
            w = dequantize_int4(q.weight()) if cls is Int4Linear else dequantize_int8(_int8_weight(q))
            getattr(getattr(dl, parent), name).weight.data.copy_(w)
    ids = list(range(3, 40))
    assert torch.allclose(Generator(quantised).logits(ids), Generator(dense).logits(ids), atol=1e-4)


def _int8_weight(layer: Int8Linear):
    from llmd.quant.int8 import Int8Weight

    return Int8Weight(layer.qweight, layer.scales, layer.group_size)


def test_int4_weights_take_a_fifth_of_fp32(model_dir) -> None:
    quantised = load_model(resolve_model(model_dir), quant=QuantConfig("int4")).model
    projections = [m for m in quantised.modules() if isinstance(m, Int4Linear)]
    held = sum(weight_bytes(m) for m in projections)  # packed nibbles + fp32 scales and mins (+ biases)
    fp32 = sum(4 * m.in_features * m.out_features for m in projections)
    assert len(projections) == 4 * quantised.config.num_layers
    assert held <= 0.2 * fp32


def test_generate_with_quant_and_a_bad_group_size(model_dir, capsys) -> None:
    assert main(["generate", "hi", "--model", str(model_dir), "--quant", "int4", "--max-tokens", "4",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip() != ""
    # The tiny model's hidden size is 64: groups of 128 cannot divide it.
    assert main(["generate", "hi", "--model", str(model_dir), "--quant", "int4", "--group-size", "128"]) == 1
    err = capsys.readouterr().err
    assert "llmd: error: cannot quantise" in err and "group size 128 must divide" in err and "Traceback" not in err
