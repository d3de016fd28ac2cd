"""Quality gate for the quantisation formats: perplexity of the default model on a fixed text.

    .venv/bin/python benchmarks/quant_quality.py [--tokens 4096] [--window 512]

The text is the docstrings of a fixed list of standard-library modules, present on every machine
(disjoint from the modules llmd.daemon.calibration calibrates INT4 requantisation on). Every row is a
model as llmd loads it (fp32 activations, so the rows compare formats, not kernel rounding):
  fp32 (Q4_1 dequantised)   --quant none: the GGUF's blocks dequantised; the reference
  native Q4_1 blocks        --quant auto: the blocks held as INT4 g32, copied bit for bit
  INT8 per channel          --quant int8: requantised from the dequantised weights
  INT4 g32 requantised      the dequantised weights requantised (fitted, calibrated) at g32
  INT4 g64 / g128           --quant int4 --group-size 64 / 128 (g64 where 128 does not divide 576)
  ... min/max               the same groups by plain min/max, without fitting or calibration
Embeddings (and the tied LM head) are held in fp32 in every row.
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch

MODULES = ["json", "inspect", "argparse", "collections", "pathlib", "functools", "itertools", "logging",
           "subprocess", "typing", "dataclasses", "re", "os", "string", "textwrap", "unittest"]


@torch.inference_mode()
def perplexity(model, ids: list[int], window: int) -> float:
    from llmd.daemon.reference_generator import Generator

    gen = Generator(model)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        logits = gen.logits(chunk[:-1]).float()
        targets = torch.tensor(chunk[1:])
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += len(targets)
    return math.exp(nll / count)


def requantised(dense, group_size: int, source, calibrated: bool = True):
    """``dense`` with every projection requantised to INT4 ``group_size`` as the loader does for a
    float checkpoint (fitted, calibrated), or by plain min/max."""
    from llmd.daemon.loader import _importance
    from llmd.daemon.quantization import PROJECTIONS, QuantConfig, plan_linears, quantize_linears
    from llmd.quant.int4 import Int4Linear, quantize_int4

    model = copy.deepcopy(dense)
    quant = QuantConfig("int4", group_size)
    plan = plan_linears(model.config, quant, "cpu")
    if calibrated:
        quantize_linears(model, quant, plan, _importance(model, source, list(plan)))
        return model
    for i, layer in enumerate(model.model.layers):
        for proj in PROJECTIONS:
            parent, name = proj.split(".")
            d = layer.get_submodule(proj)
            g = plan[f"model.layers.{i}.{proj}"].group_size
            setattr(getattr(layer, parent), name, Int4Linear.from_weight(quantize_int4(d.weight.data, g)))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args()

    from llmd.daemon.loader import load_model
    from llmd.daemon.model_source import resolve_model
    from llmd.daemon.tokenizer import load_tokenizer
    from llmd.daemon.quantization import QuantConfig
    from llmd.daemon.calibration_text import stdlib_docstrings

    source = resolve_model(None)

    def load(scheme: str, group_size: int | None = None):
        return load_model(source, dtype=torch.float32, quant=QuantConfig(scheme, group_size)).model

    dense = load("none")
    ids = load_tokenizer(source).encode(stdlib_docstrings(MODULES))[: args.tokens + 1]
    rows = [
        ("fp32 (Q4_1 dequantised)", lambda: dense),
        ("native Q4_1 blocks", lambda: load("auto")),
        ("INT8 per channel", lambda: load("int8")),
        ("INT4 g32 requantised", lambda: requantised(dense, 32, source)),
        ("INT4 g64", lambda: load("int4", 64)),
        ("INT4 g128", lambda: load("int4", 128)),
        ("INT4 g64 min/max", lambda: requantised(dense, 64, source, calibrated=False)),
        ("INT4 g128 min/max", lambda: requantised(dense, 128, source, calibrated=False)),
    ]
    print(f"{len(ids) - 1} tokens of stdlib docstrings, windows of {args.window}")
    base = None
    for name, build in rows:
        start = time.perf_counter()
        model = build()
        built = time.perf_counter() - start
        ppl = perplexity(model, ids, args.window)
        base = base or ppl
        print(f"{name:<26} perplexity {ppl:8.3f}   {100 * (ppl / base - 1):+6.2f}% vs fp32   (built in {built:.0f}s)",
              flush=True)


if __name__ == "__main__":
    main()
