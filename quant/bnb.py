"""bitsandbytes weight backends: NF4 (``--quant nf4``) and LLM.int8 (``--quant bnb-int8``).

Both are bitsandbytes' own modules, used as transformers uses them, so a projection held here
computes what a ``load_in_4bit`` / ``load_in_8bit`` model computes:

* NF4 (QLoRA): 4-bit NormalFloat codes in blocks of 64 weights, one fp32 absmax per block
  (4.5 bits a weight). No double quantisation of the absmax: it would save 0.4 bit a weight
  on the GPU, but the AVX512-BF16 CPU kernel undoes it, and transformers leaves it off by default.
* LLM.int8: int8 weights with one scale per output row; activations are quantised per row too,
  except columns holding an outlier above 6.0 (the paper's and transformers' threshold), which
  are multiplied in fp16. Activations are cast to fp16 on the way, so they must stay below 65504.
  The outlier columns are picked over the whole batch, so a row's result moves slightly with the
  rows batched with it (threshold 0 would not, but that is no longer LLM.int8).

Whether bitsandbytes runs a scheme on a device is found out by running it, once per process, on a
small matrix (:func:`bnb_unsupported_reason`): its backends differ by version, build and CPU, and
a wrong answer should be a clear error at load, not garbage at generation. bitsandbytes is
imported only then: it takes seconds (it imports torch._dynamo).

What bitsandbytes 0.50.2 does on the CPU, found by trying it:

* both schemes run, with fp32, bf16 and fp16 inputs;
* on CPUs with AVX512-BF16 the first forward of an NF4 module in eval mode repacks its weight
  (absmax to bf16) for a fused kernel that computes in bf16 whatever the compute dtype, and
  asserts the output size is a multiple of 32;
* its native NF4 dequantisation is wrong when the input size is not a multiple of the block size
  (quantisation runs over the flattened weight, dequantisation applies absmax per row block).

:func:`bnb_linear` hence requires input sizes that are multiples of 64 (on every device, so a
model quantises alike everywhere), turns the repacking off for other output sizes, and runs that
first forward itself, so nothing changes later, under ``inference_mode`` or in the byte count.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch
from torch import nn

BNB_SCHEMES = ("nf4", "bnb-int8")
NF4_BLOCK_SIZE = 64
INT8_THRESHOLD = 6.0
_NAMES = {"nf4": "NF4", "bnb-int8": "LLM.int8"}
_INSTEAD = "use --quant int4 or int8 (llmd's own formats) instead"
# Log lines bitsandbytes writes that say nothing to an llmd user: at import, on AVX512-BF16 CPUs,
# that the optional `kernels` package (a faster NF4 GEMM fetched from the Hub) is missing, which
# it falls back from; and on every LLM.int8 forward, that non-fp16 inputs are cast to fp16.
_QUIET = ("Failed to load CPU gemm_4bit_forward", "MatMul8bitLt: inputs will be cast")


class _DropBnbNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_QUIET)


def _import_bnb() -> ModuleType:
    for name in ("bitsandbytes.backends.cpu.ops", "bitsandbytes.autograd._functions"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropBnbNoise) for f in logger.filters):
            logger.addFilter(_DropBnbNoise())
    import bitsandbytes

    return bitsandbytes


def bnb_unsupported_reason(scheme: str, device: str | torch.device) -> str | None:
    """None if bitsandbytes runs ``scheme`` (``nf4`` or ``bnb-int8``) on ``device`` (``cpu`` or
    ``cuda``) with this install, else one sentence saying why and what to do. Tried for real on a
    small matrix the first time, then cached."""
    return _reason(scheme, torch.device(device).type)


@functools.cache
def _reason(scheme: str, device: str) -> str | None:
    if scheme not in BNB_SCHEMES:
        return f"{scheme!r} is not a bitsandbytes scheme ({', '.join(BNB_SCHEMES)})"
    name = _NAMES[scheme]
    if device == "cuda" and not torch.cuda.is_available():
        return f"{name} on cuda needs a CUDA GPU and torch {torch.__version__} sees none; use --device cpu"
    try:
        bnb = _import_bnb()
    except ImportError as e:
        return f"bitsandbytes is not installed ({e}); pip install 'bitsandbytes>=0.44', or {_INSTEAD}"
    try:
        error = _probe(scheme, device)
    except Exception as e:  # whatever a missing backend or kernel raises
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return (f"bitsandbytes {bnb.__version__} cannot run {name} on {device} "
                f"({type(e).__name__}{': ' + detail if detail else ''}); {_INSTEAD}")
    if error > 0.3:  # NF4 is off by ~10% on random weights, LLM.int8 by ~1%
        return f"bitsandbytes {bnb.__version__} computes {name} wrongly on {device} (off by {error:.0%}); {_INSTEAD}"
    return None


def _probe(scheme: str, device: str) -> float:
    """Worst relative error of a 64x64 ``scheme`` module against the dense product, in each model
    dtype."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 64, generator=g), torch.randn(4, 64, generator=g)
    ref = x @ w.T
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        y = _build(w, None, scheme, dtype, device)(x.to(device, dtype))
        if y.dtype != dtype or y.shape != ref.shape:
            raise TypeError(f"returned {y.dtype} {tuple(y.shape)} for {dtype} {tuple(x.shape)}")
        worst = max(worst, ((y.float().cpu() - ref).norm() / ref.norm()).item())
    return worst


def bnb_linear(weight: torch.Tensor, bias: torch.Tensor | None, scheme: str, compute_dtype: torch.dtype,
               device: str | torch.device) -> nn.Module:
    """``y = x W^T + b`` with ``weight`` ``[N, K]`` held by bitsandbytes as ``scheme``, quantised on
    ``device``. Takes ``[T, K]`` inputs in ``compute_dtype`` (the model dtype) and returns that
    dtype; ``module.quant_scheme`` names the scheme.

    Raises:
        ValueError: bitsandbytes cannot run ``scheme`` on ``device`` here, or NF4's block size does
            not divide ``K``.
    """
    if reason := bnb_unsupported_reason(scheme, device):
        raise ValueError(reason)
    in_features = weight.shape[1]
    if scheme == "nf4" and in_features % NF4_BLOCK_SIZE:
        raise ValueError(f"nf4 needs input sizes that are multiples of {NF4_BLOCK_SIZE} (its block size), "
                         f"got {in_features}; {_INSTEAD}")
    return _build(weight, bias, scheme, compute_dtype, str(device))


def _build(weight: torch.Tensor, bias: torch.Tensor | None, scheme: str, compute_dtype: torch.dtype,
           device: str) -> nn.Module:
    bnb = _import_bnb()
    out_features, in_features = weight.shape
    # From the CPU: Int8Params quantises only when moved off it (Params4bit on any move), and both
    # then quantise on `device`. Built on meta so no random init of a dense weight is paid for.
    w = weight.detach().to("cpu", torch.float32)
    if scheme == "nf4":
        module = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None, compute_dtype=compute_dtype,
                                   compress_statistics=False, quant_type="nf4", device="meta")
        module.weight = bnb.nn.Params4bit(w, requires_grad=False, blocksize=NF4_BLOCK_SIZE,
                                          compress_statistics=False, quant_type="nf4", module=module)
        # The CPU repacking asserts N % 32 == 0; other sizes take the dequantise-and-matmul path.
        module.support_avx512bf16_for_cpu &= out_features % 32 == 0
    else:
        module = bnb.nn.Linear8bitLt(in_features, out_features, bias=bias is not None, has_fp16_weights=False,
                                     threshold=INT8_THRESHOLD, device="meta")
        module.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
    if bias is not None:
        # In the compute dtype: both modules otherwise convert it in place on every call.
        module.bias = nn.Parameter(bias.detach().to(compute_dtype), requires_grad=False)
    module = module.to(device).eval()  # eval: LLM.int8's inference path, NF4's CPU kernel
    # bitsandbytes finishes on the first call (NF4's CPU repacking, LLM.int8 moving its scales to
    # the module state): do it now, outside inference_mode, so the module is as held from here on.
    with torch.no_grad():
        module(torch.ones(1, in_features, dtype=compute_dtype, device=device))
    module.quant_scheme = scheme
    return module


def bnb_weight_bytes(module: nn.Module) -> int:
    """Bytes the quantised weight takes as held, with its quantisation state (NF4: absmax and code
    table; LLM.int8: row scales); the bias is not counted."""
    weight = module.weight
    tensors = [weight.data]
    state = getattr(weight, "quant_state", None)
    if state is not None:  # NF4
        tensors += [state.absmax, state.code]
        if state.nested:
            tensors += [state.offset, state.state2.absmax, state.state2.code]
    else:  # LLM.int8: the scales sit on the weight until the first call, then on the module state
        scb = weight.SCB if getattr(weight, "SCB", None) is not None else module.state.SCB
        tensors.append(scb)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
