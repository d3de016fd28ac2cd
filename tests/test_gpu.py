"""The GPU test set (`make gpu-report`, or `LLMD_GPU_TESTS=1 pytest -m gpu tests/test_gpu.py`): every
Triton kernel compiled and run on a CUDA device against the torch reference on the CPU, bf16
included (which the interpreter cannot run through tl.dot), then the engine on the GPU against
the CPU. Skipped in `make test`: there the interpreter runs the same kernels on CPU tensors.

With LLMD_GPU_TESTS=1 but no CUDA device, the kernel tests run in the interpreter on the CPU
(bf16 tensor-core cases skipped): that checks this file itself where no GPU is.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from test_attention_triton import CASES, SEQ_LENS, PagedBatch, check_decode_from_qkv, max_err, paged_batch, reference
from test_norm_act_triton import ulps
from test_quant_triton import CANARY, rel_err, weight

from llmd.daemon.model_config import RopeConfig
from llmd.daemon.models.layers import RMSNorm, RotaryEmbedding, rope_torch
from llmd.kernels import attention_ref as ref
from llmd.kernels import attention_triton as at
from llmd.kernels import norm_act_triton as na
from llmd.kernels import quant_matmul_triton as qmt
from llmd.quant.int4 import Int4Weight, dequantize_int4, quantize_int4
from llmd.quant.int8 import dequantize_int8, quantize_int8

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
GPU_SET = os.environ.get("LLMD_GPU_TESTS") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPU_SET, reason="the GPU test set: make gpu-report (LLMD_GPU_TESTS=1 pytest -m gpu)"),
]
# (only in the GPU test set: elsewhere the module's own skip says why, once)
needs_cuda = pytest.mark.skipif(GPU_SET and not ON_GPU,
                                reason="needs a CUDA device (compiled kernels, not the interpreter)")
# bf16 through tl.dot is wrong in the interpreter (triton#11584), and it rounds fp32 -> bf16 by
# truncation where a GPU rounds to nearest: bf16 cases only on a GPU
BF16 = pytest.param(torch.bfloat16, marks=needs_cuda, id="bfloat16")
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.float16, id="float16"), BF16]
# max |out - ref| (attention) or max |out - ref| / max |ref| (matmuls): bf16 has 8 bits of mantissa.
ATTN_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
MATMUL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def on_device(batch: PagedBatch) -> PagedBatch:
    return PagedBatch(batch.query.to(DEVICE), batch.k_cache.to(DEVICE), batch.v_cache.to(DEVICE),
                      batch.block_tables.to(DEVICE), batch.query_lens, batch.seq_lens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_attention_on_the_device(case: int, dtype: torch.dtype) -> None:
    num_kv_heads, group, head_dim, block_size, _ = CASES[case]
    decode = paged_batch([1] * len(SEQ_LENS), SEQ_LENS, num_kv_heads, group, head_dim, block_size, dtype, seed=1)
    expected, d = reference(decode), on_device(decode)
    for splits in (None, 1, 3, 8):
        out = at.decode_attention(d.query, d.k_cache, d.v_cache, d.block_tables, decode.seq_lens_t.to(DEVICE),
                                  max(decode.seq_lens), head_dim ** -0.5, None, splits)
        assert out.device.type == DEVICE.type and max_err(out.cpu(), expected) < ATTN_TOL[dtype], splits
    contexts = [0, 0, 7, 21, 35]
    extend = paged_batch(SEQ_LENS, [q + c for q, c in zip(SEQ_LENS, contexts)], num_kv_heads, group, head_dim,
                         block_size, dtype, seed=2)
    e = on_device(extend)
    out = at.extend_attention(e.query, e.k_cache, e.v_cache, e.block_tables, extend.query_start_loc.to(DEVICE),
                              extend.seq_lens_t.to(DEVICE), max(extend.query_lens), head_dim ** -0.5, None)
    assert max_err(out.cpu(), reference(extend)) < ATTN_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [0, 3, 5])
def test_decode_from_the_qkv_projection_on_the_device(case: int, dtype: torch.dtype) -> None:
    """The decode step's attention (RoPE, q/k norm, KV write, split-K combined by the last program
    to arrive) on the device: the combine's ordering through L2 is only real on a GPU."""
    num_kv_heads, group, head_dim, block_size, _ = CASES[case]
    for variant in ("plain", "qk_norm+window"):
        check_decode_from_qkv(num_kv_heads, group, head_dim, block_size, dtype, variant, DEVICE, ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="float16"), BF16])  # bf16: the interpreter
def test_write_kv_on_the_device(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    k_cache, v_cache = (torch.randn(6, 16, 3, 80, generator=g).to(dtype) for _ in range(2))
    qkv = torch.randn(5, 10, 80, generator=g)
    key, value = qkv[:, 4:7], qkv[:, 7:]
    slots = torch.tensor([0, 17, 95, -1, 40])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    ref.write_kv(expected_k, expected_v, key[slots >= 0], value[slots >= 0], slots[slots >= 0])
    dk, dv = k_cache.to(DEVICE), v_cache.to(DEVICE)
    at.write_kv(dk, dv, key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(dk.cpu(), expected_k) and torch.equal(dv.cpu(), expected_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 64, 200])  # one-row GEMV, tensor-core GEMV, GEMM, dense
def test_quant_matmuls_on_the_device(m: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 576, generator=g).to(dtype)
    q4 = quantize_int4(weight(960, 576, 32, g), 32)  # the default model's qkv shape and group size
    out = qmt.int4_matmul(x.to(DEVICE), q4.packed.to(DEVICE), q4.scales.to(DEVICE), q4.mins.to(DEVICE), 32)
    assert rel_err(out.cpu(), x.float() @ dequantize_int4(q4).T) < MATMUL_TOL[dtype]
    q8 = quantize_int8(weight(200, 576, 576, g))
    out = qmt.int8_matmul(x.to(DEVICE), q8.qweight.to(DEVICE), q8.scales.to(DEVICE), q8.group_size)
    assert rel_err(out.cpu(), x.float() @ dequantize_int8(q8).T) < MATMUL_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 16, 64])  # one-row GEMV, tensor-core GEMV, its last row count, GEMM
def test_fused_matmuls_on_the_device(m: int, dtype: torch.dtype) -> None:
    """The decode step's projections: the norm before qkv and gate/up, SiLU x up before down with
    the residual add after it, against the torch layers on the CPU."""
    g = torch.Generator().manual_seed(m + 1)
    q4 = quantize_int4(weight(576, 1536, 32, g), 32)  # the default model's down projection
    w_ref = dequantize_int4(q4).to(dtype).float()
    dev = [t.to(DEVICE) for t in (q4.packed, q4.scales, q4.mins)]
    norm_w, x = torch.randn(1536, generator=g).to(dtype), (torch.randn(m, 1536, generator=g) * 3).to(dtype)
    qkv_like = qmt.fused_int4(*dev, 32, dtype, norm=(norm_w.to(DEVICE), 1e-5))
    normed = RMSNorm(1536, 1e-5, dtype)
    normed.weight.copy_(norm_w)
    want = normed(x).float() @ w_ref.T
    assert rel_err(qkv_like(x.to(DEVICE)).cpu(), want) < 2 * MATMUL_TOL[dtype]
    down_like = qmt.fused_int4(*dev, 32, dtype, silu=True, add_residual=True)
    gate_up, residual = (torch.randn(m, 3072, generator=g) * 3).to(dtype), (torch.randn(m, 576, generator=g) * 300)
    gate, up = gate_up.chunk(2, dim=-1)
    want = residual.to(dtype).float() + (F.silu(gate) * up).float() @ w_ref.T
    got = down_like(gate_up.to(DEVICE), residual.to(dtype).clone().to(DEVICE)).cpu()  # (added into in place)
    assert rel_err(got, want) < 2 * MATMUL_TOL[dtype] and rel_err(got, residual) > CANARY


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])  # one row; 2..16 rows (32 features in 6 column groups)
def test_one_launch_mlp_on_the_device(m: int, dtype: torch.dtype) -> None:
    """The decode step's MLP in one launch (llmd.kernels.mlp_triton), the default model's shapes:
    the last program of each column group to arrive combines the others' partials through L2,
    which only a GPU really orders; against the torch MLP on the CPU, deterministic, x unchanged."""
    from test_mlp_triton import AGAINST_TORCH, bound, mlp_weights, torch_mlp

    from llmd.kernels.mlp_triton import FusedMLP

    gate_up, down, norm_w, g = mlp_weights(576, 1536, 32, dtype, seed=m)
    on_dev = lambda w: Int4Weight(w.packed.to(DEVICE), w.scales.to(DEVICE), w.mins.to(DEVICE), w.group_size)
    mlp = FusedMLP(*bound(on_dev(gate_up), on_dev(down), norm_w.to(DEVICE), dtype))
    x = (torch.randn(m, 576, generator=g) * 30).to(dtype)
    on = x.to(DEVICE)
    first, second = torch.empty_like(on), torch.empty_like(on)
    assert mlp(on, first, torch.empty(0, device=DEVICE)) is first
    mlp(on, second, torch.empty(0, device=DEVICE))
    want = torch_mlp(x, gate_up, down, norm_w)
    assert torch.equal(first, second) and torch.equal(on.cpu(), x)
    assert (first.cpu().float() - want).abs().max() / (want - x.float()).abs().max() < AGAINST_TORCH[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_kernels_on_the_device(dtype: torch.dtype) -> None:
    """Within the bounds of tests/test_norm_act_triton.py, bf16 one unit tighter (a GPU rounds to
    nearest where the interpreter truncates)."""
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5, dtype)
    norm.weight.copy_(torch.randn(576))
    x, residual = torch.randn(6, 576).to(dtype), torch.randn(6, 576).to(dtype)
    # (copies: the kernels work in place, and on the CPU .to() would hand them the originals)
    got, got_sum = na.add_rms_norm(x.to(DEVICE), residual.clone().to(DEVICE), norm.weight.to(DEVICE), 1e-5)
    assert ulps(got_sum.cpu(), x + residual) == 0 and ulps(got.cpu(), norm(x + residual)) <= 2.5

    rope = RotaryEmbedding(RopeConfig(theta=100000.0), 64)
    positions = torch.tensor([0, 1, 7, 1000, 8191, 100_000])
    q, k = torch.randn(6, 9, 64).to(dtype), torch.randn(6, 3, 64).to(dtype)
    cos, sin = rope.cos_sin(positions, dtype)
    dq, dk = na.rope_qk_(q.clone().to(DEVICE), k.clone().to(DEVICE), positions.to(DEVICE), rope.inv_freq.to(DEVICE))
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}[dtype]  # as test_norm_act_triton
    torch.testing.assert_close(dq.cpu().float(), rope_torch(q, cos, sin).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(dk.cpu().float(), rope_torch(k, cos, sin).float(), atol=tol, rtol=tol)

    gate_up = (torch.randn(5, 3072) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert ulps(na.silu_mul(gate_up.to(DEVICE)).cpu(), F.silu(gate) * up) <= (4 if dtype == torch.float32 else 1)


@needs_cuda
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_the_default_model_on_the_gpu(cuda_graphs: bool) -> None:
    """The default model on the GPU (auto dtype, Triton everything) answers as on the CPU: the
    canary's margin, and greedy tokens of a batch equal with and without CUDA graphs."""
    from llmd import LLM, SamplingParams
    from llmd.daemon.reference_generator import Generator

    llm = LLM(device="cuda", cuda_graphs=cuda_graphs)
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompt += llm.encode("The capital of France is")
    top2 = Generator(llm.engine.model).logits(prompt)[-1].topk(2)
    assert llm.tokenizer.decode([int(top2.indices[0])]) == " Paris"
    assert float(top2.values[0] - top2.values[1]) > 4
    # decode steps through the fused step (llmd.kernels.decode_triton): greedy answers the canary
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3))[0].text.startswith(" Paris")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([f"Count from {i}:" for i in range(6)], params)
    assert all(len(o.token_ids) == 24 for o in outs)
    if cuda_graphs:
        eager = LLM(device="cuda").generate([f"Count from {i}:" for i in range(6)], params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in eager]

