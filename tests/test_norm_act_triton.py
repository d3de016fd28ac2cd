"""The fused Triton kernels of a decoder layer (RMSNorm + residual, RoPE of q and k, SiLU x up), run
by the Triton interpreter on the CPU against the torch reference in llmd.daemon.models.layers, and
compiled for every GPU generation the daemon targets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gpu_compile import compile_for_gpu

from llmd.daemon.model_config import RopeConfig
from llmd.daemon.models.layers import RMSNorm, RotaryEmbedding, rope_torch
from llmd.kernels import norm_act_triton as na

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| in units of the last place of ``want``'s dtype at ``want``'s magnitude.
    NOTE: the interpreter rounds fp32 -> bf16 by truncation (a GPU rounds to nearest), so bf16
    results may sit one unit off the reference's; fp16 and fp32 round as on a GPU."""
    eps = torch.finfo(want.dtype).eps
    scale = want.float().abs().clamp_min(torch.finfo(want.dtype).tiny / eps)
    return ((got.float() - want.float()).abs() / (scale * eps)).max().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_the_reference(dtype: torch.dtype, with_residual: bool) -> None:
    torch.manual_seed(0)
    hidden = 200  # not a power of two: the kernel masks the tail of its block
    norm = RMSNorm(hidden, 1e-5, dtype)
    norm.weight.copy_(torch.randn(hidden))
    wide = torch.randn(6, hidden + 24).to(dtype)
    x = wide[:, :hidden]  # a strided view, as a slice of a fused output would be
    residual = torch.randn(6, hidden).to(dtype) if with_residual else None
    want_sum = x + residual if with_residual else x
    want = norm(want_sum)

    got, got_sum = na.add_rms_norm(x, None if residual is None else residual.clone(), norm.weight, 1e-5)
    assert ulps(got_sum, want_sum) <= (1 if dtype == torch.bfloat16 else 0)
    assert ulps(got, want) <= 2.5, "within rounding of the reference"
    # A wrong eps, a missing weight or a norm over the wrong width is far off.
    assert ulps(na.add_rms_norm(x, None, torch.ones_like(norm.weight), 1e-5)[0], want) > 50


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 2, 64), (3, 1, 80), (8, 8, 128)], ids=str)
def test_rope_of_q_and_k_matches_the_reference(dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim = heads
    tokens = 9
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q = qkv[:, :num_heads * head_dim].view(tokens, num_heads, head_dim)  # strided views into qkv
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    # Positions up to 10^5: angles that large need an accurate cos/sin, not an approximation.
    positions = torch.tensor([0, 1, 2, 17, 500, 4095, 4096, 31999, 100_000])
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim)
    cos, sin = rope.cos_sin(positions, dtype)
    want_q, want_k = rope_torch(q, cos, sin), rope_torch(k, cos, sin)
    wrong_q = rope_torch(q, *rope.cos_sin(positions + 1, dtype))

    got_q, got_k = na.rope_qk_(q, k, positions, rope.inv_freq)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr(), "rotated in place"
    # The reference rounds each product to the dtype, the kernel once: a few units of the larger term.
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}[dtype]
    torch.testing.assert_close(got_q.float(), want_q.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_k.float(), want_k.float(), atol=tol, rtol=tol)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before), "v untouched"
    # A position off by one is far outside that tolerance.
    assert (wrong_q.float() - want_q.float()).abs().max() > 10 * tol


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_the_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    width = 1500  # two column blocks, the second masked
    gate_up = (torch.randn(5, 2 * width) * 4).to(dtype)
    gate, up = gate_up.split(width, dim=-1)
    want = F.silu(gate) * up
    got = na.silu_mul(gate_up)
    assert got.shape == (5, width) and got.dtype == dtype
    # fp32: exp and the division are the interpreter's (numpy), not torch's vectorised ones: a few
    # units apart; fp16/bf16 round both to the same value but for the interpreter's bf16 truncation.
    assert ulps(got, want) <= {torch.float32: 4, torch.float16: 1, torch.bfloat16: 2}[dtype]
    assert ulps(na.silu_mul(torch.cat([up, gate], dim=-1)), want) > 50, "gate and up are not interchangeable"


def test_bad_arguments_are_value_errors() -> None:
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight"):
        na.add_rms_norm(x, None, torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        na.add_rms_norm(x, torch.randn(3, 8).half(), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="2-D"):
        na.add_rms_norm(torch.randn(8), None, torch.ones(8), 1e-5)
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="positions"):
        na.rope_qk_(q, k, torch.arange(3), torch.ones(4))
    with pytest.raises(ValueError, match="inv_freq"):
        na.rope_qk_(q, k, torch.arange(2), torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous last"):
        na.rope_qk_(q.transpose(1, 2), k, torch.arange(2), torch.ones(4))
    with pytest.raises(ValueError, match="even width"):
        na.silu_mul(torch.randn(2, 7))
    assert na.silu_mul(torch.randn(0, 8)).shape == (0, 4)


COMPILE = """
from llmd.kernels import norm_act_triton as na

ARCH_DTYPES = [(arch, dt) for arch in ARCHS for dt in ("fp16", "bf16")] + ([(80, "fp32")] if 80 in ARCHS else [])
for arch, dt in ARCH_DTYPES:
    kernels = [
        compile_for(na._add_rms_norm_kernel,
                    dict(x_ptr=f"*{dt}", res_ptr=f"*{dt}", w_ptr=f"*{dt}", out_ptr=f"*{dt}", n="i32", eps="fp32",
                         stride_x="i32", stride_r="i32", stride_o="i32"),
                    dict(HAS_RESIDUAL=True, BLOCK=8192), arch,
                    aligned=("x_ptr", "res_ptr", "w_ptr", "out_ptr", "n", "stride_x", "stride_r", "stride_o")),
        compile_for(na._rope_qk_kernel,
                    dict(q_ptr=f"*{dt}", k_ptr=f"*{dt}", pos_ptr="*i64", inv_freq_ptr="*fp32", stride_qt="i32",
                         stride_qh="i32", stride_kt="i32", stride_kh="i32"),
                    dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HALF=64, BLOCK_QH=32, BLOCK_KH=8, BLOCK_HALF=64), arch,
                    aligned=("q_ptr", "k_ptr", "pos_ptr", "inv_freq_ptr", "stride_qt", "stride_qh", "stride_kt",
                             "stride_kh")),
        compile_for(na._silu_mul_kernel, dict(x_ptr=f"*{dt}", out_ptr=f"*{dt}", n="i32", stride_x="i32",
                                              stride_o="i32"),
                    dict(BLOCK=na.SILU_BLOCK), arch, aligned=("x_ptr", "out_ptr", "n", "stride_x", "stride_o")),
    ]
    for kernel in kernels:
        r = ptxas_report(kernel)
        print(r)
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["shared"] <= 99 * 1024, r
        assert r["vector_loads"], r
    rope_ptx = kernels[1].asm["ptx"]
    assert "__nv_cosf" in rope_ptx and "sin.approx" not in rope_ptx and "cos.approx" not in rope_ptx
"""


def test_kernels_compile_for_every_gpu_generation(tmp_path: Path) -> None:
    """sm_75/80/86/90 in fp16 and bf16 (and fp32 once), with the alignment the runtime sees: no
    register spills, shared memory within a consumer card's 99 KiB, vectorised global loads, and
    RoPE on libdevice's accurate cos/sin."""
    out = compile_for_gpu(COMPILE, tmp_path)
    assert out.count("'registers'") == 3 * (2 * 4 + 1), out[-2000:]
