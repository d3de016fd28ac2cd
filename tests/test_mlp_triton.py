"""The one-launch MLP of the GPU decode step (llmd.kernels.mlp_triton), run by the Triton
interpreter on the CPU: against the two GEMVs it replaces and against the torch MLP on the same
INT4 weights, deterministic, falling back to the two GEMVs where it should; compiled for every GPU
generation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gpu_compile import compile_for_gpu
from test_quant_triton import CANARY, dtype_id, rel_err, weight

import llmd.kernels.mlp_triton as mlp_triton
import llmd.kernels.quant_matmul_triton as qmt
from llmd.kernels.decode_triton import bind_mlp
from llmd.kernels.launch import arrival_counters
from llmd.quant.int4 import dequantize_int4, quantize_int4
from llmd.quant.int8 import quantize_int8

# max |out - two GEMVs| / max |MLP|: fp32 and fp16 differ by summation order only (fp16 may flip
# one rounding of gate or up); bf16 in the interpreter truncates at each of its five roundings.
AGAINST_GEMVS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# against torch's MLP in fp32 on the dequantised weights (the kernels round the weights and each
# step to the activations' dtype)
AGAINST_TORCH = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-2}


def mlp_weights(hidden: int, intermediate: int, group_size: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate_up = quantize_int4(weight(2 * intermediate, hidden, group_size, g) * 0.1, group_size)
    down = quantize_int4(weight(hidden, intermediate, group_size, g) * 0.1, group_size)
    norm_w = (2 * torch.randn(hidden, generator=g)).to(dtype)  # far from ones: the canary below
    return gate_up, down, norm_w, g


def bound(gate_up, down, norm_w, dtype: torch.dtype):
    g = gate_up.group_size
    return (qmt.fused_int4(gate_up.packed, gate_up.scales, gate_up.mins, g, dtype, norm=(norm_w, 1e-5)),
            qmt.fused_int4(down.packed, down.scales, down.mins, g, dtype, silu=True, add_residual=True))


def torch_mlp(x: torch.Tensor, gate_up, down, norm_w: torch.Tensor) -> torch.Tensor:
    """The Llama MLP with its norm and residual, in fp32, on the dequantised weights."""
    x32 = x.float()
    h = norm_w.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5))
    gate, up = F.linear(h, dequantize_int4(gate_up)).chunk(2, dim=-1)
    return x32 + F.linear(F.silu(gate) * up, dequantize_int4(down))


# (rows, hidden, intermediate, group size, dtype): one row (fp32 FMAs) and 2..16 (tensor cores),
# K tiles of one group and of several, slices of one group and of several; bf16 only for one row
# (the interpreter cannot run bf16 tl.dot, triton#11584).
CASES = [(1, 128, 128, 32, torch.float32), (1, 128, 192, 64, torch.float32), (1, 96, 128, 32, torch.bfloat16),
         (3, 96, 128, 32, torch.float32), (5, 128, 128, 128, torch.float16), (16, 64, 128, 32, torch.float16)]


@pytest.mark.parametrize(("m", "hidden", "intermediate", "group_size", "dtype"), CASES, ids=dtype_id)
def test_one_launch_mlp_matches_the_two_gemvs_and_torch(m: int, hidden: int, intermediate: int, group_size: int,
                                                        dtype: torch.dtype) -> None:
    gate_up, down, norm_w, g = mlp_weights(hidden, intermediate, group_size, dtype, seed=m + hidden)
    gu, d = bound(gate_up, down, norm_w, dtype)
    mlp = mlp_triton.FusedMLP(gu, d)
    assert mlp._plan(m) is not None, "the case must take the one launch"
    x = (torch.randn(m, hidden, generator=g) * 100).to(dtype)  # a residual stream as large as the MLP adds
    two = x.clone()
    d(gu(two), two)
    got = torch.empty_like(x)
    assert mlp(x, got, torch.empty(m, 2 * intermediate, dtype=dtype)) is got
    added = (two.float() - x.float()).abs().max()
    assert (got.float() - two.float()).abs().max() / added < AGAINST_GEMVS[dtype]
    want = torch_mlp(x, gate_up, down, norm_w)
    assert (got.float() - want).abs().max() / (want - x.float()).abs().max() < AGAINST_TORCH[dtype]
    # Canaries: without the residual, or without the norm's weight, the result is far off.
    assert (got.float() - (want - x.float())).abs().max() / added > CANARY
    no_norm = torch.empty_like(x)
    mlp_triton.FusedMLP(*bound(gate_up, down, torch.ones_like(norm_w), dtype))(x, no_norm, torch.empty(0))
    assert rel_err(no_norm - x, want - x.float()) > CANARY


def test_one_launch_mlp_is_deterministic_and_resets_its_counters() -> None:
    """The last program of each group of columns to arrive adds the partials in slice order: two
    launches agree bit for bit, and the groups' arrival counters are zero after each (the next
    launch, or a CUDA graph's replay, counts from zero). x itself is only read."""
    gate_up, down, norm_w, g = mlp_weights(96, 128, 32, torch.float32, seed=9)
    mlp = mlp_triton.FusedMLP(*bound(gate_up, down, norm_w, torch.float32))
    x = torch.randn(2, 96, generator=g)
    kept = x.clone()
    first, second = torch.empty_like(x), torch.empty_like(x)
    mlp(x, first, torch.empty(0))
    groups = mlp_triton.mlp_plan(128, 96, 2, 264)[1]
    assert groups > 1 and not arrival_counters(x.device, groups)[:groups].any()
    mlp(x, second, torch.empty(0))
    assert torch.equal(first, second) and torch.equal(x, kept) and not torch.equal(first, x)


def test_the_plan_fills_the_gpu_and_bounds_the_combine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model's MLP: 48 slices of 32 features in 6 groups of columns, 288 programs (at
    least 2 per SM of a 132-SM GPU, as the GEMVs), at every batch size; a wide model's stays two
    GEMVs; where the partials would be too many for a combining program, the columns split into
    more groups, one row's slices widen, and beyond that the MLP is two GEMVs, bit for bit, in
    place, through the buffer the step gives it."""
    for rows in (1, 16):
        block_i, groups = mlp_triton.mlp_plan(1536, 576, rows, 2 * 132)
        assert block_i == 32 and 1536 // block_i * groups >= 2 * 132
    assert mlp_triton.mlp_plan(14336, 4096, 1, 264) is None  # an 8B model: two GEMVs
    assert mlp_triton.mlp_plan(100, 576, 1, 264) is None  # no slice divides it
    gate_up, down, norm_w, g = mlp_weights(64, 128, 32, torch.float32, seed=4)
    gu, d = bound(gate_up, down, norm_w, torch.float32)
    # 1 KB of partials per combining program: one row's of 4 slices (4 x 64 columns x 4 bytes)
    # fit; two rows' only in two column groups; under 1 KB, one row's in wider slices.
    monkeypatch.setattr(mlp_triton, "COMBINE_MAX_BYTES", 1024)
    assert mlp_triton.mlp_plan(128, 64, 1, 1) == (32, 1)
    assert mlp_triton.mlp_plan(128, 64, 2, 1) is None and mlp_triton.mlp_plan(128, 64, 2, 264) == (32, 2)
    monkeypatch.setattr(mlp_triton, "COMBINE_MAX_BYTES", 1023)
    assert mlp_triton.mlp_plan(128, 64, 1, 1) == (64, 1)
    monkeypatch.setattr(mlp_triton, "COMBINE_MAX_BYTES", 1024)
    monkeypatch.setattr(mlp_triton, "programs_wanted", lambda device: 1)
    mlp = mlp_triton.FusedMLP(gu, d)
    assert mlp._plan(3) is None
    x = torch.randn(3, 64, generator=g)
    two, buffer = x.clone(), torch.empty(3, 256)
    d(gu(two), two)
    got = x.clone()
    assert mlp(got, torch.empty_like(x), buffer) is got  # the two GEMVs, in place
    assert torch.equal(got, two) and torch.equal(buffer, gu(x))


def test_what_cannot_be_one_launch_stays_two() -> None:
    g = torch.Generator().manual_seed(3)
    gate_up, down, norm_w, _ = mlp_weights(64, 128, 32, torch.float32, seed=3)
    gu, d = bound(gate_up, down, norm_w, torch.float32)
    q8 = quantize_int8(weight(256, 64, 32, g), 32)
    gu8 = qmt.fused_int8(q8.qweight, q8.scales, 32, torch.float32, norm=(norm_w, 1e-5))
    bad = [((gu8, d), "INT4 weights"), ((d, d), "norm prologue"), ((gu, gu), "SiLU"),
           ((bound(quantize_int4(weight(256, 64, 32, g), 32), quantize_int4(weight(64, 96, 32, g), 32), norm_w,
                   torch.float32)), "not one MLP's")]
    for (a, b), message in bad:
        with pytest.raises(ValueError, match=message):
            mlp_triton.FusedMLP(a, b)
        assert not isinstance(bind_mlp(a, b), mlp_triton.FusedMLP)  # the decode step keeps two launches
    assert isinstance(bind_mlp(gu, d), mlp_triton.FusedMLP)
    x = torch.randn(1, 64, generator=g)
    two, got = x.clone(), x.clone()
    d(gu8(two), two)
    assert bind_mlp(gu8, d)(got, torch.empty_like(x), torch.empty(1, 256)) is got  # the two launches, in place
    assert torch.equal(got, two) and rel_err(got, x) > CANARY


# The kernel compiled for every GPU generation (see gpu_compile.py) with the alignment the runtime
# sees, in its four variants (one row of 32, 64 or 128 features; 2..16 rows of 32; the default
# model launches the 32s), its tiles as FusedMLP picks them, group size 32: in gpu_compile's dtypes
# (the 64 and 128 in the architecture's first).
COMPILE_FOR_GPU = """
import llmd.kernels.mlp_triton as m

sig = {"gu_packed_ptr": "*u8", "gu_scales_ptr": "*fp16", "gu_mins_ptr": "*fp16", "d_packed_ptr": "*u8",
       "d_scales_ptr": "*fp16", "d_mins_ptr": "*fp16", "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32",
       "H": "i32", "I": "i32", "eps": "fp32", "stride_xm": "i32", "stride_om": "i32", "stride_gw": "i32",
       "stride_gs": "i32",
       "stride_dw": "i32", "stride_ds": "i32"}
aligned = [name for name in sig if name.endswith("_ptr") or name.startswith("stride_") or name in ("H", "I")]
aligned += ["x_ptr", "norm_w_ptr", "out_ptr"]
reports = []
for arch in ARCHS:
    for x in dtypes(arch):
        # (the wider one-row slices, for models wider than the default: in the architecture's first dtype)
        for block_m, block_i in ((1, 32), (16, 32)) + (((1, 64), (1, 128)) if x == dtypes(arch)[0] else ()):
            constexprs = m._tiles(block_m, block_i, 576, 32)
            warps = constexprs.pop("num_warps")
            constexprs.update(BLOCK_M=block_m, BLOCK_I=block_i, DNG=block_i // 32, DGH=16, GROUP_SIZE=32,
                              NORM_BLOCK=256)
            kernel = compile_for(m._int4_mlp_kernel, dict(sig, x_ptr=f"*{x}", norm_w_ptr=f"*{x}", out_ptr=f"*{x}"),
                                 constexprs, arch, aligned, num_warps=warps)
            r = ptxas_report(kernel)
            print(block_m, "rows", block_i, "features", x, r)
            reports.append((block_m, block_i, x, r))
for *variant, r in reports:
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (variant, r)
    assert r["shared"] <= 99 * 1024, (variant, r)
    assert r["vector_loads"] and not r["byte_loads"], (variant, r)
"""


def test_one_launch_mlp_compiles_for_every_gpu_generation(tmp_path: Path) -> None:
    out = compile_for_gpu(COMPILE_FOR_GPU, tmp_path)
    assert out.count("'registers'") == 2 * (1 + 3 + 2 * 1) + 2 * 4, out[-2000:]  # sm_75, sm_80, sm_86/90
