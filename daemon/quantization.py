"""``--quant``: which format each decoder projection is held in, and what the weights take.

The projections of every decoder layer (fused qkv, o, fused gate/up, down) are quantised;
embeddings, norms and the LM head (tied to the embeddings in most small models) stay in the model
dtype: they are a small share of a large model, and a quantised LM head costs the most quality
per byte saved. ``llmd status`` reports this.

For llmd's own formats the model is built with empty quantised projections (a
:data:`LinearFactory` from :func:`linear_factory`) that quantise each checkpoint tensor as it
streams in, or copy GGUF Q4_0/Q4_1/Q8_0 blocks as they are: no dense copy of the model is ever
held. bitsandbytes (``nf4``, ``bnb-int8``) builds its modules from whole dense weights, so those
schemes convert a dense model after loading (:func:`quantize_linears`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from llmd.daemon.model_config import ModelConfig
from llmd.daemon.models.layers import Linear, LinearFactory, dense_linear
from llmd.daemon.models.llama import PACKED_PROJECTIONS
from llmd.daemon.process_memory import release_free_memory
from llmd.config import QUANT_SCHEMES, check_quant_pair
from llmd.quant.bnb import BNB_SCHEMES, bnb_linear, bnb_unsupported_reason
from llmd.quant.int4 import Int4Linear
from llmd.quant.int8 import Int8Linear

log = logging.getLogger("llmd")

# GGUF block types held as they are, and the format that holds them.
NATIVE_GGUF = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}
_FLOAT_GGUF = ("F32", "F16", "BF16")
# Other GGUF types with 5 or more bits per weight keep more of their precision in INT8.
_WIDE_GGUF = ("Q5_0", "Q5_1", "Q5_K", "Q6_K")
# Projection module paths within a decoder layer, and the checkpoint tensors each is made of.
PROJECTIONS = PACKED_PROJECTIONS


@dataclass(slots=True)
class QuantConfig:
    """``scheme``: ``auto`` (keep a GGUF's own blocks; INT4 for float checkpoints), ``none``,
    ``int8`` (per output channel unless ``group_size``), ``int4`` (asymmetric, ``group_size``),
    ``nf4`` or ``bnb-int8`` (bitsandbytes). Raises ``ValueError`` on unknown schemes or group sizes."""

    scheme: str = "auto"
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.scheme not in QUANT_SCHEMES:
            raise ValueError(f"quantisation must be one of {', '.join(QUANT_SCHEMES)}, got {self.scheme!r}")
        if self.group_size is not None and self.group_size not in (32, 64, 128):
            raise ValueError(f"group size must be 32, 64 or 128, got {self.group_size}")
        check_quant_pair(self.scheme, self.group_size)


@dataclass(frozen=True, slots=True)
class LinearSpec:
    """How one projection is held: ``int4`` / ``int8`` with ``group_size`` (None: per channel)."""

    scheme: str
    group_size: int | None = None
    symmetric: bool = False

    def describe(self) -> str:
        return f"{self.scheme} {f'g{self.group_size}' if self.group_size else 'per channel'}"


def _group_size(in_features: int, wanted: int, fallen_back: dict[tuple[int, int], int]) -> int:
    """``wanted``, or the largest smaller group size (64, 32) that divides ``in_features`` (e.g.
    128 does not divide SmolLM2's 576): records the fallback for one log line."""
    for g in (128, 64, 32):
        if g <= wanted and in_features % g == 0:
            if g != wanted:
                fallen_back[(wanted, in_features)] = g
            return g
    raise ValueError(f"group size {wanted} must divide the input dimension {in_features} (no group size of "
                     f"32, 64 or 128 does)")


def plan_linears(config: ModelConfig, quant: QuantConfig, device: str,
                 gguf_types: Mapping[str, str] | None = None) -> dict[str, LinearSpec]:
    """The format of every quantised projection, by module path (``model.layers.3.mlp.down_proj``).

    ``gguf_types`` maps checkpoint tensor names to GGUF type names (``Q4_1``) for a GGUF model.
    Projections not in the plan stay dense; bitsandbytes schemes plan nothing here.

    Raises:
        ValueError: no group size of 32 or more divides an int4/int8 projection's input size, or
            bitsandbytes cannot run the scheme on ``device``.
    """
    if quant.scheme in BNB_SCHEMES:
        if reason := bnb_unsupported_reason(quant.scheme, device):
            raise ValueError(reason)
        return {}
    if quant.scheme == "none":
        return {}
    sizes = {"self_attn.qkv_proj": config.hidden_size, "self_attn.o_proj": config.q_size,
             "mlp.gate_up_proj": config.hidden_size, "mlp.down_proj": config.intermediate_size}
    plan: dict[str, LinearSpec] = {}
    requantised: dict[str, str] = {}
    fallen_back: dict[tuple[int, int], int] = {}
    for i in range(config.num_layers):
        for proj, parts in PROJECTIONS.items():
            path, k = f"model.layers.{i}.{proj}", sizes[proj]
            if quant.scheme == "int8":
                plan[path] = LinearSpec("int8", quant.group_size and _group_size(k, quant.group_size, fallen_back))
            elif quant.scheme == "int4":
                plan[path] = LinearSpec("int4", _group_size(k, quant.group_size or 32, fallen_back))
            else:  # auto
                types = {gguf_types[f"model.layers.{i}.{p}.weight"] for p in parts} if gguf_types else set()
                natives = {NATIVE_GGUF.get(t) for t in types}
                if types and len(natives) == 1 and None not in natives:
                    # Q4_0 and Q4_1 are both INT4 g32 (Q4_0's min is -8 * scale).
                    plan[path] = LinearSpec(natives.pop(), 32, symmetric=types == {"Q4_0"})
                elif types and types & set(_WIDE_GGUF):
                    plan[path] = LinearSpec("int8", None)
                else:
                    # Small models lose a lot at coarse groups (benchmarks/quant_quality.py), so the CPU
                    # default is 32; on a GPU 128 halves the scale traffic.
                    wanted = quant.group_size or (128 if device == "cuda" else 32)
                    try:
                        plan[path] = LinearSpec("int4", _group_size(k, wanted, fallen_back))
                    except ValueError:  # no group divides K: per-channel INT8 always fits
                        plan[path] = LinearSpec("int8", None)
                        fallen_back[(wanted, k)] = 0
                for t in types - set(NATIVE_GGUF) - set(_FLOAT_GGUF) if types else ():
                    requantised[t] = plan[path].describe()
    for (wanted, k), g in fallen_back.items():
        log.info("group size %d does not divide the input size %d of some projections: they use %s", wanted, k,
                 f"group size {g}" if g else "int8 per channel")
    for t, target in requantised.items():
        log.info("GGUF %s tensors are dequantised and requantised to %s (llmd holds only int4/int8)", t, target)
    return plan


def linear_factory(plan: Mapping[str, LinearSpec]) -> LinearFactory:
    """Build planned projections as empty quantised modules (the loader fills them), others dense."""

    def make(name: str, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> nn.Module:
        spec = plan.get(name)
        if spec is None:
            return dense_linear(name, in_features, out_features, bias, dtype)
        if spec.scheme == "int8":
            return Int8Linear(in_features, out_features, spec.group_size, bias, dtype)
        return Int4Linear(in_features, out_features, spec.group_size, bias, dtype, spec.symmetric)

    return make


def gguf_blocks_wanted(plan: Mapping[str, LinearSpec], gguf_types: Mapping[str, str]) -> set[str]:
    """Checkpoint tensors whose GGUF blocks a planned module copies as they are (same format and
    group size), so the loader hands them over undequantised."""
    return {name for path, spec in plan.items() for name in _part_names(path)
            if NATIVE_GGUF.get(gguf_types.get(name, "")) == spec.scheme and spec.group_size == 32}


def calibrated_paths(plan: Mapping[str, LinearSpec], blocks: set[str]) -> list[str]:
    """INT4 projections that are requantised rather than copied from GGUF blocks: these are fitted
    with calibration (:func:`quantize_linears`), so the loader builds them dense first."""
    return [path for path, spec in plan.items() if spec.scheme == "int4" and not set(_part_names(path)) <= blocks]


def _part_names(path: str) -> list[str]:
    """Checkpoint weight names a projection is made of: ``model.layers.3.mlp.gate_up_proj`` ->
    ``model.layers.3.mlp.gate_proj.weight``, ``model.layers.3.mlp.up_proj.weight``."""
    layer, _, proj = path.partition(".layers.")[2].partition(".")
    return [f"model.layers.{layer}.{part}.weight" for part in PROJECTIONS[proj]]


def quantize_linears(model: nn.Module, quant: QuantConfig, plan: Mapping[str, LinearSpec] | None = None,
                     importance: Mapping[str, torch.Tensor] | None = None) -> None:
    """Replace a loaded model's dense projections with quantised ones, in place.

    INT4 groups are fitted (:func:`llmd.quant.int4_fit.quantize_int4_fitted`), weighted by
    ``importance[path]`` (mean squared input per feature, :mod:`llmd.daemon.calibration`) where given.
    """
    from llmd.quant.int4_fit import quantize_int4_fitted

    device = next(model.parameters()).device.type
    plan = plan_linears(model.config, quant, device) if plan is None else plan
    make = linear_factory(plan)
    for i, layer in enumerate(model.model.layers):
        for proj in PROJECTIONS:
            path = f"model.layers.{i}.{proj}"
            parent_name, name = proj.split(".")
            parent = getattr(layer, parent_name)
            dense: Linear = getattr(parent, name)
            if not isinstance(dense, Linear) or (quant.scheme not in BNB_SCHEMES and path not in plan):
                continue
            bias = None if dense.bias is None else dense.bias.data
            weight = dense.weight.data.float()
            if quant.scheme in BNB_SCHEMES:
                module = bnb_linear(weight, bias, quant.scheme, compute_dtype=model.dtype, device=device)
            else:
                module = make(path, dense.in_features, dense.out_features, bias is not None, model.dtype)
                spec = plan[path]
                if spec.scheme == "int4":
                    module.load_rows(0, quantize_int4_fitted(weight, spec.group_size, spec.symmetric,
                                                             (importance or {}).get(path)))
                else:
                    module.load_rows(0, weight)
                if bias is not None:
                    module.bias.data.copy_(bias)
            setattr(parent, name, module)


# Bytes of weights converted between two hand-backs of the freed heap during prepare().
TRIM_EVERY_BYTES = 128 << 20


def prepare(model: nn.Module) -> None:
    """Once loaded: convert each quantised projection to its kernel's layout for the model dtype,
    then let the model set up its head and decode step on them.

    The heap each conversion frees (the blocks as the file had them) is handed back to the system
    every TRIM_EVERY_BYTES: glibc keeps freed blocks below its mmap threshold for reuse, and a layer's
    new layout rarely fits the old one's holes, so a 3B's load otherwise peaked ~100 MiB above what it
    holds after (measured: 2,511 against 2,417 MiB; with the trims the peak is the end)."""
    converted = 0
    for module in model.modules():
        if isinstance(module, (Int4Linear, Int8Linear)):
            module.prepare(model.dtype)
            converted += module.in_features * module.out_features // (2 if isinstance(module, Int4Linear) else 1)
            if converted >= TRIM_EVERY_BYTES:
                release_free_memory()
                converted = 0
    model.prepare_head()
    model.prepare_decode()


HEAD_Q8 = "int8 g32 LM head"  # weight_memory's key for the head's Q8_0 blocks (LlamaForCausalLM.head_q8)


def weight_memory(model: nn.Module) -> dict[str, int]:
    """Bytes of weights as held, by format: each quantised projection scheme, and ``dense <dtype>``
    for everything else (embeddings, norms, LM head, biases)."""
    out: dict[str, int] = {}
    counted: set[int] = set()
    for module in model.modules():
        if isinstance(module, Int4Linear):
            key = f"int4 g{module.group_size}"
        elif isinstance(module, Int8Linear):
            key = "int8 per channel" if module.group_size == module.in_features else f"int8 g{module.group_size}"
        elif hasattr(module, "quant_scheme"):  # bitsandbytes modules (llmd.quant.bnb)
            key = module.quant_scheme
        else:
            continue
        tensors = [t for t in list(module.parameters()) + list(module.buffers()) if t is not module.bias]
        if hasattr(module, "quant_scheme"):
            from llmd.quant.bnb import bnb_weight_bytes

            nbytes = bnb_weight_bytes(module)  # bitsandbytes keeps its scales outside the parameters
        else:
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
        out[key] = out.get(key, 0) + nbytes
        counted.update(id(t) for t in tensors)
    head_q8 = getattr(model, "head_q8", None)
    if head_q8 is not None:
        out[HEAD_Q8] = head_q8.nbytes
    for t in model.parameters():  # buffers outside quantised modules are caches (RoPE), not weights
        if id(t) not in counted:
            key = f"dense {str(t.dtype).removeprefix('torch.')}"
            out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out


def describe_quant(model: nn.Module, quant: QuantConfig) -> str:
    """What ``--quant`` made of ``model``: ``int4 g32 projections (--quant auto); embeddings, norms and
    LM head bfloat16``."""
    memory = weight_memory(model)
    formats = sorted(k for k in memory if not k.startswith("dense ") and k != HEAD_Q8)
    dense = str(model.dtype).removeprefix("torch.")
    tied = getattr(model, "embeds_from_head", False)  # the embedding is the head's blocks too
    head = f"; {'embeddings and ' if tied else ''}LM head int8 g32 (the checkpoint's Q8_0)" if HEAD_Q8 in memory else ""
    if not formats:
        return f"none (--quant {quant.scheme}): all weights {dense}{head}"
    rest = "norms" if tied else "embeddings and norms" if head else "embeddings, norms and LM head"
    return f"{' + '.join(formats)} projections (--quant {quant.scheme}); {rest} {dense}{head}"


def describe(memory: Mapping[str, int]) -> str:
    """One line: ``62 MiB int4 g32 projections, 57 MiB dense bfloat16 (embeddings, norms)``."""
    parts = []
    for key, nbytes in sorted(memory.items(), key=lambda kv: -kv[1]):
        what = "(embeddings, norms)" if key.startswith("dense") else "" if key == HEAD_Q8 else "projections"
        parts.append(f"{nbytes / 2**20:.0f} MiB {key} {what}".rstrip())
    return ", ".join(parts)
