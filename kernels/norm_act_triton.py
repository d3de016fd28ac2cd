"""Triton kernels for the elementwise work of a decoder layer on the GPU, fused so that a decode
step launches few kernels (issue 19: a step is launch-bound long before it is bandwidth-bound):

* :func:`add_rms_norm`: the residual add and the RMSNorm after it, one launch instead of ~9;
* :func:`rope_qk_`: RoPE of q and k together, in place, with cos/sin computed from the positions
  in the kernel (no per-step cos/sin tables), one launch instead of ~17;
* :func:`silu_mul`: ``SiLU(gate) * up`` straight from the fused gate/up projection's output, one
  launch instead of 2 (and no strided copy);
* :func:`around_matmul`: the norm or SiLU before a matmul and the bias and residual add after it,
  as separate kernels: what the quantised GEMVs fuse into their one launch, for the matmuls that
  do not (prompt chunks, dense projections).

Numerics follow the torch reference in ``llmd.daemon.models.layers`` step by step: the residual
sum is rounded to the activations' dtype, the norm is taken in fp32 and rounded before the weight
multiplies it, SiLU is rounded before ``* up``. RoPE rounds cos/sin to the dtype as the reference
does but rotates in fp32 and rounds once (the reference rounds each product): within an ulp of the
dtype. Tested in Triton's interpreter against the reference (tests/test_norm_act_triton.py) and
compiled for GPU targets there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from llmd.kernels.launch import cdiv, next_power_of_2

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SILU_BLOCK = 1024  # columns per program of silu_mul


def _num_warps(block: int) -> int:
    """Warps for a program over ``block`` elements: ~8 elements per thread, 1 to 16 warps."""
    return min(16, max(1, block // 256))


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, eps, stride_x, stride_r, stride_o,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)  # rounded as torch's x + r
        tl.store(res_ptr + row * stride_r + offs, x, mask=mask)  # the new residual, in place
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n + eps)
    normed = (x32 * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded before the weight
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(ptr, stride_h, num_heads, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    """Rotate-half RoPE of one token's ``num_heads`` heads at ``ptr`` (``[heads, 2 * HALF]``)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    lo_ptr = ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    lo = tl.load(lo_ptr, mask=mask, other=0.0)
    hi = tl.load(lo_ptr + HALF, mask=mask, other=0.0)
    lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
    tl.store(lo_ptr, (lo32 * cos[None, :] - hi32 * sin[None, :]).to(lo.dtype), mask=mask)
    tl.store(lo_ptr + HALF, (hi32 * cos[None, :] + lo32 * sin[None, :]).to(lo.dtype), mask=mask)


@triton.jit
def _rope_qk_kernel(q_ptr, k_ptr, pos_ptr, inv_freq_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + offs_d, mask=offs_d < HALF, other=0.0)
    angle = tl.load(pos_ptr + t).to(tl.float32) * inv_freq  # as the reference: fp32 position x fp32 frequency
    # NOTE: tl.cos/tl.sin compile to libdevice's __nv_cosf/__nv_sinf (checked in the PTX by the
    # compile test), accurate at angles of 10^5 radians, not the approx instructions whose error
    # grows with the angle. Rounded to the dtype, as the reference's tables are.
    cos = tl.cos(angle).to(q_ptr.dtype.element_ty).to(tl.float32)
    sin = tl.sin(angle).to(q_ptr.dtype.element_ty).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, NUM_Q_HEADS, cos, sin, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, NUM_KV_HEADS, cos, sin, HALF, BLOCK_KH, BLOCK_HALF)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as F.silu's
    tl.store(out_ptr + row * stride_o + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(name: str, x: torch.Tensor, width: int | None = None) -> None:
    if x.ndim != 2 or (width is not None and x.shape[1] != width):
        raise ValueError(f"{name} must be 2-D [T, {width if width is not None else 'N'}], got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if x.shape[1] and x.stride(1) != 1:
        raise ValueError(f"{name}'s rows must be contiguous")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)`` for ``x [T, N]``; the sum is written into
    ``residual`` in place and returned as it. Without a residual: ``(rms_norm(x) * weight, x)``."""
    _check_rows("x", x)
    n = x.shape[1]
    if weight.shape != (n,) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must be [{n}] {x.dtype} on {x.device}, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    if residual is not None:
        _check_rows("residual", residual, n)
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual must match x ({tuple(x.shape)} {x.dtype}), got "
                             f"{tuple(residual.shape)} {residual.dtype}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel():
        block = next_power_of_2(n)
        _add_rms_norm_kernel[(x.shape[0],)](
            x, x if residual is None else residual, weight, out, n, eps, x.stride(0),
            0 if residual is None else residual.stride(0), out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block))
    return out, x if residual is None else residual


def rope_qk_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` in place (rotate-half RoPE, the Hugging Face
    layout) at ``positions [T]`` with the fp32 frequencies ``inv_freq [D/2]``; returns them. Their
    last dimension must be contiguous (views into the fused qkv output are fine)."""
    for name, x in (("q", q), ("k", k)):
        if x.ndim != 3 or x.stride(2) != 1:
            raise ValueError(f"{name} must be [T, heads, head_dim] with a contiguous last dimension")
        if x.dtype not in _DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    tokens, _, head_dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != head_dim or k.dtype != q.dtype or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must share tokens, "
                         f"an even head dim and the dtype")
    if positions.shape != (tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [{tokens}] int32/int64, got {tuple(positions.shape)} {positions.dtype}")
    if inv_freq.shape != (head_dim // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be [{head_dim // 2}] float32, got {tuple(inv_freq.shape)} {inv_freq.dtype}")
    if not (q.device == k.device == positions.device == inv_freq.device):
        raise ValueError("q, k, positions and inv_freq must be on one device")
    if tokens:
        _rope_qk_kernel[(tokens,)](
            q, k, positions, inv_freq, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            NUM_Q_HEADS=q.shape[1], NUM_KV_HEADS=k.shape[1], HALF=head_dim // 2,
            BLOCK_QH=next_power_of_2(q.shape[1]), BLOCK_KH=next_power_of_2(k.shape[1]),
            BLOCK_HALF=next_power_of_2(head_dim // 2))
    return q, k


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``SiLU(gate) * up`` ``[T, I]`` from the fused projection's output ``gate_up [T, 2I]``
    (gate first)."""
    _check_rows("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even width (gate then up), got {gate_up.shape[1]}")
    n = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        grid = (gate_up.shape[0], cdiv(n, SILU_BLOCK))
        _silu_mul_kernel[grid](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=SILU_BLOCK, num_warps=4)
    return out


def around_matmul(x: torch.Tensor, matmul: Callable[[torch.Tensor], torch.Tensor], *,
                  norm: tuple[torch.Tensor, float] | None = None, silu: bool = False,
                  bias: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``matmul`` with the decode step's fusions as separate kernels, rounded as the fused GEMVs
    round (llmd.kernels.quant_matmul_triton): x replaced by ``weight * rms_norm(x)`` (``norm=(weight,
    eps)``) or by ``SiLU(gate) * up`` (``silu``, x ``[M, 2K]``), then ``bias`` added to the product,
    then the product added into ``residual`` in place (returned)."""
    if norm is not None:
        x = add_rms_norm(x, None, norm[0], norm[1])[0]
    elif silu:
        x = silu_mul(x)
    out = matmul(x)
    if bias is not None:
        out = out + bias
    return out if residual is None else residual.add_(out)
