"""A decode step's whole MLP in one launch: norm, gate/up, SiLU x up, down and the residual add.

The fused decode step (llmd.kernels.decode_triton) runs an MLP as two GEMVs, gate/up then down,
because down needs every intermediate feature of a row and no GEMV program has them all. Here each
program owns a slice of ``BLOCK_I`` intermediate features instead:

1. it computes gate and up for its slice from the normed residual stream (each program reads the
   whole row for its ``1 / rms``, a few KB from L2, as the GEMVs' norm prologue does);
2. ``SiLU(gate) * up`` for the slice, in registers;
3. the slice's share of down: down split over its K (the intermediate features) by slice, the
   fp32 partial sums written to a workspace ``[P, BLOCK_M, hidden]``;
4. the last program to arrive adds the ``P`` partials in program order (deterministic, as the
   GEMVs' split-K) and the residual, and resets its counter (CUDA-graph safe).

So that the launch fills the GPU (a model has few slices: 48 in the default model), the output
columns are also split among ``C`` groups of programs: program ``(p, c)`` computes slice ``p``'s
gate and up (again for each ``c``, from L2) and its share of down for the columns of group ``c``,
and the last of the ``P`` programs of group ``c`` combines that group's columns. The combine is
then ``C`` programs side by side, each reading ``P x rows x hidden / C`` partials. Because
programs of other groups may still be reading x when a group's combine finishes, the result goes
to another tensor (``out = x + MLP(x)``), not into x in place.

A layer is then four launches (qkv, attention, o, MLP), not five (issue 19: a small model's GPU
decode step is bound by its launches). :func:`mlp_plan` picks the smallest slice (the most
programs) whose combine reads at most ``COMBINE_MAX_BYTES`` per program; for a model or batch
where none does (a wide model), the step keeps its two GEMVs. The bound is a guess: what the
recomputed gate/up and the combine cost against a launch saved can only be measured on a GPU
(README "GPU status").

Rounding follows the two GEMVs step for step: gate and up rounded to the activations' dtype as the
gate/up GEMV stores them, SiLU and the product rounded as the down GEMV's prologue rounds, the
dequantised weights rounded as every GEMV rounds them; only the fp32 summation order differs.

The intermediate features of a slice are taken as even and odd ones apart: byte ``i`` of an INT4
row holds elements ``2i`` and ``2i + 1``, so down's packed bytes for the slice multiply the even
features by their low nibbles and the odd ones by their high nibbles, and gate/up's rows are loaded
as the two halves, each row still a run of contiguous bytes (16-byte loads). INT4 weights only;
an INT8 or dense MLP keeps its two launches.

Tested on the CPU with the Triton interpreter against the two GEMVs and the torch reference
(tests/test_mlp_triton.py), and compiled for sm_75 to sm_90 there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from llmd.kernels.launch import arrival_counters, cdiv, next_power_of_2, workspace
from llmd.kernels.quant_matmul_triton import (GEMV_DOT_BLOCK_M, GEMV_MAX_M, GEMV_NORM_BLOCK, FusedMatmul, _epilogue,
                                              _gemv_rows, _x_values, programs_wanted)

# Slices of intermediate features a program may own: multiples of 32 (16 packed bytes, one vector
# load per row of down), smallest first (more programs, more of the GPU reading weights). Wider
# slices for one row only: with 2..16 rows on tensor cores they spill registers on sm_86/sm_90.
BLOCK_IS = (32, 64, 128)
# The partials one combining program reads, at most (see the module's note; untuned).
COMBINE_MAX_BYTES = 512 * 1024
MAX_BLOCK_K = 128  # gate/up's K tile over the hidden features, at most


def mlp_plan(intermediate: int, hidden: int, rows: int, wanted: int) -> tuple[int, int] | None:
    """``(BLOCK_I, C)`` for a step of ``rows`` rows: slices of ``BLOCK_I`` features, the output
    columns in ``C`` groups (as many as bring the launch to ``wanted`` programs, at most one per
    column tile); None when the MLP should stay two GEMVs. Decided per power-of-two bucket of rows,
    as the warm-up and the CUDA graphs see them, so a row count never launches a variant the
    warm-up did not compile."""
    bucket = next_power_of_2(rows)
    for block_i in BLOCK_IS if bucket == 1 else BLOCK_IS[:1]:
        if intermediate % block_i:
            continue
        programs = intermediate // block_i
        block_n = _block_n(1 if bucket == 1 else GEMV_DOT_BLOCK_M, block_i)
        n_tiles = cdiv(hidden, block_n)
        groups = min(n_tiles, max(1, cdiv(wanted, programs)))
        if programs * bucket * cdiv(n_tiles, groups) * block_n * 4 <= COMBINE_MAX_BYTES:
            return block_i, groups
    return None


@triton.jit
def _int4_rows(packed_ptr, scales_ptr, mins_ptr, r, mask_r, stride_w, stride_s, k0, GROUP_SIZE: tl.constexpr,
               NG: tl.constexpr, GH: tl.constexpr, x_dtype: tl.constexpr):
    """The dequantised K tile at ``k0`` of the INT4 rows ``r``: ``(lo, hi)`` ``[R, NG, GH]``, the
    even and the odd elements, each group of ``2 * GH`` elements with its scale and min, rounded to
    the activations' dtype as the GEMVs round them."""
    offs_g = tl.arange(0, NG)
    tile_byte = offs_g[:, None] * GH + tl.arange(0, GH)[None, :]
    byte = tl.load(packed_ptr + r[:, None, None] * stride_w + k0 // 2 + tile_byte[None, :, :],
                   mask=mask_r[:, None, None], other=0)
    group = (k0 + offs_g * (2 * GH)) // GROUP_SIZE
    s_ptrs = r[:, None] * stride_s + group[None, :]
    scale = tl.load(scales_ptr + s_ptrs, mask=mask_r[:, None], other=0.0).to(tl.float32)[:, :, None]
    min_ = tl.load(mins_ptr + s_ptrs, mask=mask_r[:, None], other=0.0).to(tl.float32)[:, :, None]
    lo = ((byte & 0xF).to(tl.float32) * scale + min_).to(x_dtype)
    hi = ((byte >> 4).to(tl.float32) * scale + min_).to(x_dtype)
    return lo, hi


@triton.jit
def _dot_tile(xe, xo, lo, hi, acc, R: tl.constexpr, KH: tl.constexpr):
    """``acc [BLOCK_M, R] += xe @ lo^T + xo @ hi^T`` for a tile ``[R, NG, GH]`` (tensor cores; fp32
    activations at full precision, as torch's fp32 matmul)."""
    lo2 = tl.trans(tl.reshape(lo, (R, KH)))
    hi2 = tl.trans(tl.reshape(hi, (R, KH)))
    if xe.dtype == tl.float32:
        acc = tl.dot(xe, lo2, acc, input_precision="ieee")
        acc = tl.dot(xo, hi2, acc, input_precision="ieee")
    else:
        acc = tl.dot(xe, lo2, acc)
        acc = tl.dot(xo, hi2, acc)
    return acc


@triton.jit
def _silu_mul(gate, up, x_dtype: tl.constexpr):
    """``SiLU(gate) * up`` from fp32 sums, rounded as gate/up's store and down's prologue round."""
    g = gate.to(x_dtype).to(tl.float32)
    u = up.to(x_dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(x_dtype).to(tl.float32)
    return (silu * u).to(x_dtype)


@triton.jit(do_not_specialize=["M"])  # the row count changes step by step
def _int4_mlp_kernel(x_ptr, gu_packed_ptr, gu_scales_ptr, gu_mins_ptr, d_packed_ptr, d_scales_ptr, d_mins_ptr,
                     norm_w_ptr, out_ptr, part_ptr, count_ptr, M, H, I, eps, stride_xm, stride_om, stride_gw,
                     stride_gs, stride_dw, stride_ds, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_I: tl.constexpr, NG: tl.constexpr, GH: tl.constexpr, DNG: tl.constexpr, DGH: tl.constexpr,
                     BLOCK_N: tl.constexpr, NORM_BLOCK: tl.constexpr):
    # gate/up: [2I, H] (gate's I rows, then up's), its K tiles NG groups x GH bytes as the INT4
    # GEMV's; down: [H, I], the slice one K tile of DNG groups x DGH bytes (DNG * DGH = BLOCK_I / 2).
    BLOCK_K: tl.constexpr = NG * 2 * GH
    KH: tl.constexpr = NG * GH
    IH: tl.constexpr = BLOCK_I // 2
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    group_c = tl.program_id(1)  # this program's group of output columns: tiles n_lo .. n_hi - 1
    n_tiles = tl.cdiv(H, BLOCK_N)
    n_lo = group_c * n_tiles // tl.num_programs(1)
    n_hi = (group_c + 1) * n_tiles // tl.num_programs(1)
    j0 = pid * BLOCK_I
    gate_e = j0 + 2 * tl.arange(0, IH)  # the slice's even features' gate rows; +1: the odd ones
    all_rows = gate_e < 2 * I  # (I is a multiple of BLOCK_I: no row is out of range)
    rows, mask_m, row_rms = _gemv_rows(x_ptr, M, stride_xm, H, eps, BLOCK_M, 1, NORM_BLOCK)
    x_dtype = x_ptr.dtype.element_ty
    if BLOCK_M == 1:  # elementwise fp32 FMAs, summed once after the loop, as the one-row GEMV
        acc_ge = tl.zeros((IH, NG, GH), dtype=tl.float32)
        acc_go = tl.zeros((IH, NG, GH), dtype=tl.float32)
        acc_ue = tl.zeros((IH, NG, GH), dtype=tl.float32)
        acc_uo = tl.zeros((IH, NG, GH), dtype=tl.float32)
        tile_byte = tl.arange(0, NG)[:, None] * GH + tl.arange(0, GH)[None, :]
    else:
        acc_ge = tl.zeros((BLOCK_M, IH), dtype=tl.float32)
        acc_go = tl.zeros((BLOCK_M, IH), dtype=tl.float32)
        acc_ue = tl.zeros((BLOCK_M, IH), dtype=tl.float32)
        acc_uo = tl.zeros((BLOCK_M, IH), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):  # BLOCK_K divides H: no K mask
        if BLOCK_M == 1:
            k_even = k0 + 2 * tile_byte
            xe = _x_values(x_ptr, k_even, k_even, None, row_rms, norm_w_ptr, H, 1).to(tl.float32)[None, :, :]
            xo = _x_values(x_ptr, k_even + 1, k_even + 1, None, row_rms, norm_w_ptr, H, 1).to(tl.float32)[None, :, :]
            lo, hi = _int4_rows(gu_packed_ptr, gu_scales_ptr, gu_mins_ptr, gate_e, all_rows, stride_gw, stride_gs,
                                k0, GROUP_SIZE, NG, GH, x_dtype)
            acc_ge += lo.to(tl.float32) * xe + hi.to(tl.float32) * xo
            lo, hi = _int4_rows(gu_packed_ptr, gu_scales_ptr, gu_mins_ptr, gate_e + 1, all_rows, stride_gw,
                                stride_gs, k0, GROUP_SIZE, NG, GH, x_dtype)
            acc_go += lo.to(tl.float32) * xe + hi.to(tl.float32) * xo
            lo, hi = _int4_rows(gu_packed_ptr, gu_scales_ptr, gu_mins_ptr, gate_e + I, all_rows, stride_gw,
                                stride_gs, k0, GROUP_SIZE, NG, GH, x_dtype)
            acc_ue += lo.to(tl.float32) * xe + hi.to(tl.float32) * xo
            lo, hi = _int4_rows(gu_packed_ptr, gu_scales_ptr, gu_mins_ptr, gate_e + I + 1, all_rows, stride_gw,
                                stride_gs, k0, GROUP_SIZE, NG, GH, x_dtype)
            acc_uo += lo.to(tl.float32) * xe + hi.to(tl.float32) * xo
        else:  # 2..BLOCK_M rows: tensor cores, the rows padded to tl.dot's 16
            kk = k0 + 2 * tl.arange(0, KH)
            offs = rows[:, None] * stride_xm + kk[None, :]
            xe = _x_values(x_ptr, offs, kk[None, :], mask_m[:, None], row_rms, norm_w_ptr, H, 1)
            xo = _x_values(x_ptr, offs + 1, kk[None, :] + 1, mask_m[:, None], row_rms, norm_w_ptr, H, 1)
            lo, hi = _int4_rows(gu_packed_ptr, gu_scales_ptr, gu_mins_ptr, gate_e, all_rows, stride_gw, stride_gs,
                                k0, GROUP_SIZE, NG, GH, x_dtype)
            acc_ge = _dot_tile(xe, xo, lo, hi, acc_ge, IH, KH)
            lo, hi = _int4_rows(gu_packed_ptr, gu_scales_ptr, gu_mins_ptr, gate_e + 1, all_rows, stride_gw,
                                stride_gs, k0, GROUP_SIZE, NG, GH, x_dtype)
            acc_go = _dot_tile(xe, xo, lo, hi, acc_go, IH, KH)
            lo, hi = _int4_rows(gu_packed_ptr, gu_scales_ptr, gu_mins_ptr, gate_e + I, all_rows, stride_gw,
                                stride_gs, k0, GROUP_SIZE, NG, GH, x_dtype)
            acc_ue = _dot_tile(xe, xo, lo, hi, acc_ue, IH, KH)
            lo, hi = _int4_rows(gu_packed_ptr, gu_scales_ptr, gu_mins_ptr, gate_e + I + 1, all_rows, stride_gw,
                                stride_gs, k0, GROUP_SIZE, NG, GH, x_dtype)
            acc_uo = _dot_tile(xe, xo, lo, hi, acc_uo, IH, KH)
    # The slice's activations, even and odd features apart, as down's tile takes them.
    if BLOCK_M == 1:
        act_e = _silu_mul(tl.sum(tl.sum(acc_ge, axis=2), axis=1), tl.sum(tl.sum(acc_ue, axis=2), axis=1), x_dtype)
        act_o = _silu_mul(tl.sum(tl.sum(acc_go, axis=2), axis=1), tl.sum(tl.sum(acc_uo, axis=2), axis=1), x_dtype)
        act_e = tl.reshape(act_e.to(tl.float32), (DNG, DGH))[None, :, :]
        act_o = tl.reshape(act_o.to(tl.float32), (DNG, DGH))[None, :, :]
    else:
        act_e = _silu_mul(acc_ge, acc_ue, x_dtype)
        act_o = _silu_mul(acc_go, acc_uo, x_dtype)
    # The slice's share of down for the group's columns, to this program's part of the workspace.
    part = part_ptr + pid * BLOCK_M * H + rows[:, None] * H
    for tile in range(n_lo, n_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < H
        lo, hi = _int4_rows(d_packed_ptr, d_scales_ptr, d_mins_ptr, offs_n, mask_n, stride_dw, stride_ds, j0,
                            GROUP_SIZE, DNG, DGH, x_dtype)
        if BLOCK_M == 1:
            acc = tl.sum(tl.sum(lo.to(tl.float32) * act_e + hi.to(tl.float32) * act_o, axis=2), axis=1)[None, :]
        else:
            acc = _dot_tile(act_e, act_o, lo, hi, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), BLOCK_N, IH)
        tl.store(part + offs_n[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])
    tl.debug_barrier()  # every thread's partial sums are written before the arrival is counted
    arrived = tl.atomic_add(count_ptr + group_c, 1, sem="acq_rel")
    if arrived == programs - 1:  # the group's last: out = x + the sum of the slices, in slice order
        for tile in range(n_lo, n_hi):
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < H
            mask = mask_m[:, None] & mask_n[None, :]
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, programs):
                # .cg: from L2, where the other programs' stores are, never a stale L1 line
                total += tl.load(part_ptr + s * BLOCK_M * H + rows[:, None] * H + offs_n[None, :], mask=mask,
                                 other=0.0, cache_modifier=".cg")
            _epilogue(total, out_ptr, x_ptr, x_ptr, rows, mask_m, offs_n, mask_n, stride_om, stride_xm, False, True)
        tl.atomic_xchg(count_ptr + group_c, 0)


def _block_n(block_m: int, block_i: int) -> int:
    """Output columns per down tile (see :func:`_tiles`)."""
    return max(16, min(64, 1024 // (block_i // 2))) if block_m == 1 else 32


def _tiles(block_m: int, block_i: int, hidden: int, group_size: int) -> dict:
    """Tile sizes and warps of a launch, four warps, picked so that no variant spills registers on
    sm_75 to sm_90 (tests/test_mlp_triton.py compiles them all). One row: gate/up tiles of at most
    512 weights per row set, down tiles of 1,024. 2..16 rows (tensor cores, slices of 32): K tiles
    of 32 and down tiles of 32 columns (a K tile of 64 spills on sm_90 and sm_75; eight warps split
    a row's 16 bytes into single-byte loads)."""
    block_k = 2 * max(16, min(MAX_BLOCK_K // 2, 512 // (block_i // 2))) if block_m == 1 else 32
    while hidden % block_k:  # H is a multiple of the group size (>= 32): 32 always divides it
        block_k //= 2
    ng = max(1, block_k // group_size)  # groups per K tile (a tile smaller than a group lies in one)
    return dict(NG=ng, GH=block_k // ng // 2, BLOCK_N=_block_n(block_m, block_i), num_warps=4)


class FusedMLP:
    """A decode step's MLP from its two bound GEMVs (llmd.kernels.quant_matmul_triton's
    :class:`FusedMatmul`): ``gate_up`` with the post-attention norm's prologue, ``down`` with SiLU x
    up's and the residual add. ``mlp(x, out, gate_up_out)`` computes ``x + MLP(x)`` for the
    residual stream ``x [M, hidden]`` (contiguous) and returns the tensor that holds it: ``out``
    (of x's shape and dtype) where :func:`mlp_plan` takes the row count, one launch; else x,
    updated in place by the two GEMVs (``gate_up_out``: their ``[M, 2 x intermediate]`` buffer).

    Raises ValueError for projections it cannot fuse (say why; the caller keeps the two)."""

    def __init__(self, gate_up: FusedMatmul, down: FusedMatmul) -> None:
        gu, d = gate_up.weight, down.weight
        if gu.kind != "int4" or d.kind != "int4":
            raise ValueError(f"the one-launch MLP takes INT4 weights, not {gu.kind}/{d.kind}")
        if gate_up.norm is None or gate_up.silu or gate_up.bias is not None or gate_up.add_residual:
            raise ValueError("gate/up must be bound with the norm prologue alone")
        if not (down.silu and down.add_residual and down.bias is None and down.norm is None):
            raise ValueError("down must be bound with SiLU x up and the residual add alone")
        if gu.n != 2 * d.k or d.n != gu.k or gu.group_size != d.group_size or gate_up.dtype is not down.dtype:
            raise ValueError(f"gate/up {gu.n}x{gu.k} and down {d.n}x{d.k} (groups {gu.group_size}/{d.group_size}) "
                             "are not one MLP's")
        if d.k % BLOCK_IS[0]:
            raise ValueError(f"the intermediate size {d.k} is not a multiple of {BLOCK_IS[0]}")
        self.gate_up, self.down = gate_up, down
        self.hidden, self.intermediate = d.n, d.k
        self._plans: dict[int, tuple | None] = {}

    def _plan(self, rows: int) -> tuple | None:
        """``(launch, weights, scratch, sizes, kwargs)`` of a launch of ``rows`` rows (by their
        bucket), or None: the two GEMVs."""
        bucket = next_power_of_2(rows)
        if bucket in self._plans:
            return self._plans[bucket]
        gu, d = self.gate_up.weight, self.down.weight
        device = gu.tensors[0].device
        shape = mlp_plan(self.intermediate, self.hidden, rows, programs_wanted(device))
        plan = None
        if shape is not None:
            block_i, groups = shape
            block_m = 1 if bucket == 1 else GEMV_DOT_BLOCK_M
            programs = self.intermediate // block_i
            dng = max(1, block_i // gu.group_size)
            # Scratch taken now and held: a buffer grown out of later stays valid (kernels/launch.py).
            part = workspace(device, programs * block_m * self.hidden)
            kwargs = dict(_tiles(block_m, block_i, self.hidden, gu.group_size), GROUP_SIZE=gu.group_size,
                          BLOCK_M=block_m, BLOCK_I=block_i, DNG=dng, DGH=block_i // dng // 2,
                          NORM_BLOCK=GEMV_NORM_BLOCK)
            norm_w, eps = self.gate_up.norm
            # Everything but x, out and the row count, fixed: x and out are contiguous (row stride H).
            plan = (_int4_mlp_kernel[(programs, groups)], (*gu.tensors, *d.tensors, norm_w),
                    (part, arrival_counters(device, groups)),
                    (self.hidden, self.intermediate, eps, self.hidden, self.hidden, gu.tensors[0].stride(0),
                     gu.tensors[1].stride(0), d.tensors[0].stride(0), d.tensors[1].stride(0)), kwargs)
        self._plans[bucket] = plan
        return plan

    def _takes(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether x and out go to the one launch (else the two GEMVs, which check x)."""
        shape = x.shape
        # (dtypes are singletons: `is` is their equality)
        return (len(shape) == 2 and 0 < shape[0] <= GEMV_MAX_M and shape[1] == self.hidden
                and x.dtype is self.down.dtype and x.is_contiguous() and out.shape == shape
                and out.dtype is x.dtype and out.is_contiguous() and out.data_ptr() != x.data_ptr()
                and self._plan(shape[0]) is not None)

    def __call__(self, x: torch.Tensor, out: torch.Tensor, gate_up_out: torch.Tensor) -> torch.Tensor:
        if not self._takes(x, out):
            return self.down(self.gate_up(x, out=gate_up_out), x)
        launch, weights, scratch, sizes, kwargs = self._plan(x.shape[0])
        launch(x, *weights, out, *scratch, x.shape[0], *sizes, **kwargs)
        return out

    def bind(self, x: torch.Tensor, out: torch.Tensor,
             gate_up_out: torch.Tensor) -> tuple[Callable[[], object], torch.Tensor]:
        """This call with its tensors fixed, checked now: a function of nothing that launches it
        on whatever they hold then (the decode step's persistent buffers), and the tensor its
        result will be in."""
        if not self._takes(x, out):
            return functools.partial(self, x, out, gate_up_out), x
        launch, weights, scratch, sizes, kwargs = self._plan(x.shape[0])
        return functools.partial(launch, x, *weights, out, *scratch, x.shape[0], *sizes, **kwargs), out
