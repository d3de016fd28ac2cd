"""The engine with the Triton attention backend (in the interpreter, on CPU tensors) gives the same
greedy tokens as with the torch backend, through chunked prefill, prefix-cache hits, split-K decode
and sliding windows; and how the backend is chosen."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from tiny_models import make_engine, make_hf_model, run_engine, save_hf_model

from llmd.daemon.attention import (AttentionMetadata, CpuAttentionBackend, TorchAttentionBackend,
                                   TritonAttentionBackend, make_attention_backend)
from llmd.daemon.engine.sampling_params import SamplingParams

# 6 tokens a request: each is a decode step of every kernel (the interpreter's launches are most of this
# file's ~4 minutes of `make test`; 12 tokens added ~75 s and no kernel path 6 do not reach)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class RecordingTritonBackend(TritonAttentionBackend):
    """Counts, per step of layer 0, which kernel ran and what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.decode_steps = 0
        self.split_decode_steps = 0
        self.extend_steps = 0
        self.chunks_after_cached_tokens = 0  # prompt chunks behind cached context: prefix hits, later chunks
        self._layer_calls = 0

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale, sliding_window):
        self._layer_calls += 1
        if self._layer_calls % 2 == 1:  # the tiny models have 2 layers: count each step once
            if meta.max_query_len == 1:
                self.decode_steps += 1
                splits = self._kernels.decode_splits(len(meta.seq_lens), key.shape[1], meta.max_seq_len,
                                                     kv_cache[0].shape[1])
                self.split_decode_steps += splits > 1
            else:
                self.extend_steps += 1
                self.chunks_after_cached_tokens += sum(q > 1 and s > q for q, s in zip(meta.query_lens, meta.seq_lens))
        return super().forward(query, key, value, kv_cache, meta, scale, sliding_window)


def make_requests(seed: int) -> list[tuple[int, str, list[int], SamplingParams]]:
    """8 requests of 1..80 prompt tokens, half sharing a 37-token prefix (not a block multiple),
    arriving over 6 steps, so that later arrivals hit the prefix cache."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 259, (37,), generator=g).tolist()
    reqs = []
    for i in range(8):
        tail = torch.randint(0, 259, (int(torch.randint(1, 44, (1,), generator=g)),), generator=g).tolist()
        reqs.append((i * 2 % 6, f"r{i}", shared + tail if i % 2 else tail, GREEDY))
    return reqs


class CountedStep:
    """A fused decode step that counts its calls."""

    def __init__(self, step) -> None:
        self.step, self.calls = step, 0
        self.takes_mixed_steps, self.takes_prompt_chunks = step.takes_mixed_steps, step.takes_prompt_chunks
        self.bind_cache, self.bound_to, self.embed = step.bind_cache, step.bound_to, step.embed

    def __call__(self, *args):
        self.calls += 1
        return self.step(*args)


# GQA 2 + qkv bias; sliding window 16; GQA 3. Decode steps "layers": the backend's decode kernel
# (prompt chunks always go through its extend kernel); "fused": llmd.kernels.decode_triton's step
# (RoPE, the KV write and attention in one launch, the norms and adds in the matmuls'), as on a GPU.
@pytest.mark.parametrize(("model", "decode"), [("qwen2", "layers"), ("mistral", "fused"), ("smollm2", "layers")])
def test_triton_backend_matches_torch_backend(tmp_path: Path, model: str, decode: str) -> None:
    from llmd.kernels.decode_triton import DecodeStep

    model_dir = save_hf_model(make_hf_model(model), tmp_path / model, with_tokenizer=True)
    requests = make_requests(seed=len(model))
    config = dict(num_blocks=96, block_size=16, max_batched_tokens=24)  # 24: prompts arrive in chunks
    expected = run_engine(make_engine(model_dir, attention=TorchAttentionBackend(), **config), requests)
    backend = RecordingTritonBackend()
    engine = make_engine(model_dir, attention=backend, **config)
    assert isinstance(engine.model.decode_step, DecodeStep)  # dense projections take the fused step too
    step = engine.model.decode_step = CountedStep(engine.model.decode_step) if decode == "fused" else None
    assert run_engine(engine, requests) == expected
    assert engine.stats().prefix_cache_hit_rate > 0
    assert backend.extend_steps > 0 and backend.chunks_after_cached_tokens > 0
    if decode == "fused":
        assert step.calls > 0 and backend.decode_steps == 0
    else:
        assert backend.decode_steps > 0 and backend.split_decode_steps > 0


def test_the_whole_gpu_path_matches_the_reference(tmp_path: Path) -> None:
    """Everything a GPU runs, under the interpreter: Triton attention, the fused norm/RoPE/SiLU
    kernels and the Triton INT4 matmuls (GEMV with split-K for decode rows, GEMM for prompt chunks),
    decode steps through the fused step (the norms, adds, RoPE and KV write in the matmuls' and the
    attention's launches, the MLP in one; its launches bound once per row count)
    give the tokens of the torch reference on the same INT4 weights (dequantise + matmul, torch
    attention and layer ops). fp32: the interpreter cannot run bf16 tl.dot (test_quant_triton.py).
    qwen2: GQA, qkv bias, tied head; 4 requests, two sharing a prefix (the interpreter is slow)."""
    from llmd.daemon.models.layer_ops import TorchLayerOps, TritonLayerOps
    from llmd.kernels.decode_triton import DecodeStep
    from llmd.kernels.mlp_triton import FusedMLP
    from llmd.daemon.quantization import QuantConfig

    model_dir = save_hf_model(make_hf_model("qwen2"), tmp_path / "qwen2", with_tokenizer=True)
    requests = make_requests(seed=3)[:4]
    config = dict(num_blocks=96, block_size=16, max_batched_tokens=24)
    quant = QuantConfig("int4", 32)
    reference = make_engine(model_dir, attention=TorchAttentionBackend(), quant=quant, **config)
    for module in reference.model.modules():
        if hasattr(module, "cpu_path"):
            module.use("reference")
    reference.model.head_q8, reference.model.decode_step = None, None
    expected = run_engine(reference, requests)

    # Loaded as the reference was (its INT4 calibration through interpreted Triton attention would
    # triple the test's time; test_generator_on_the_triton_backend covers that path), then switched.
    gpu = make_engine(model_dir, attention=TorchAttentionBackend(), quant=quant, **config)
    gpu.model.attn_backend, gpu.model.layer_ops = TritonAttentionBackend(), TritonLayerOps()
    gpu.model.use_triton_kernels()
    assert isinstance(gpu.model.layer_ops, TritonLayerOps) and isinstance(reference.model.layer_ops, TorchLayerOps)
    assert {m.cpu_path for m in gpu.model.modules() if hasattr(m, "cpu_path")} == {"triton"}
    assert isinstance(gpu.model.decode_step, DecodeStep)  # decode steps: llmd.kernels.decode_triton's
    # four launches a layer: the MLP in one (llmd.kernels.mlp_triton)
    assert all(isinstance(layer.mlp, FusedMLP) for layer in gpu.model.decode_step.layers)
    assert run_engine(gpu, requests) == expected
    assert gpu.num_verifications > 0  # speculation on (the default): drafts verified as decode rows
    check_bound_launches(gpu)


def check_bound_launches(engine) -> None:
    """A step on the embeddings the decode step placed (embed()) runs its launches bound once
    (their arguments checked and packed at the first step of a row count and split count); a step
    on other tensors calls each kernel's wrapper. Same kernels, same arguments: bit for bit the
    same hidden states, on two row counts; new inputs rebind, and a new cache drops every binding."""
    step, caches = engine.model.decode_step, engine.runner.kv_caches
    for k, v in caches:  # these steps read slots no sequence wrote: a pool starts uninitialised (NaN, maybe)
        k.zero_()
        v.zero_()
    step.bind_cache(caches)
    for rows in (1, 3):
        check_bound_step(step, engine.model.model.embed_tokens.weight, rows)
    step.bind_cache(caches)
    assert not step._programs


@torch.inference_mode()  # as the model's forward: the step's buffers are inference tensors
def check_bound_step(step, weight: torch.Tensor, rows: int) -> None:
    import torch.nn.functional as F

    ids = torch.arange(5, 5 + rows)
    inputs = (torch.full((rows,), 1), torch.arange(rows) * 16 + 1, torch.arange(rows, dtype=torch.int32)[:, None],
              torch.full((rows,), 2, dtype=torch.int32))
    bound = step(step.embed(ids, weight), *inputs, 2).clone()
    assert (rows, 1) in step._programs
    called = step(F.embedding(ids, weight), *inputs, 2)
    assert torch.equal(bound, called) and bound.abs().max() > 0
    program = step._programs[(rows, 1)]
    fresh = tuple(t.clone() for t in inputs)
    assert torch.equal(step(step.embed(ids, weight), *fresh, 2), bound)
    assert step._programs[(rows, 1)] is not program  # bound to the new inputs


@contextmanager
def recorded_launches(variants: set, run: bool = False):
    """Record every Triton launch's kernel and compile-time arguments (constexprs, warps): what a
    GPU compiles a variant for. Kernels do not run unless ``run`` (the outputs are garbage)."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        variants.add((self.fn.__name__, tuple(sorted(kwargs.items()))))
        if run:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = record
    try:
        yield
    finally:
        InterpretedFunction.run = original


def test_the_warm_up_launches_every_kernel_variant_serving_does(tmp_path: Path) -> None:
    """Item 4 of issue 19: no compile while serving. After ModelRunner.warm_up, a workload of
    prompts of 1..80 tokens in chunks, prefix hits and decode batches of 1..8 on the GPU path
    launches no kernel variant the warm-up did not (a GPU compiles each variant at its first
    launch). Recorded, not run: the variants, not the values, are the point."""
    from llmd.daemon.models.layer_ops import TritonLayerOps
    from llmd.daemon.quantization import QuantConfig

    model_dir = save_hf_model(make_hf_model("qwen2"), tmp_path / "qwen2", with_tokenizer=True)
    engine = make_engine(model_dir, attention=TorchAttentionBackend(), quant=QuantConfig("int4", 32),
                         num_blocks=96, block_size=16, max_batched_tokens=24)
    engine.model.attn_backend, engine.model.layer_ops = TritonAttentionBackend(), TritonLayerOps()
    engine.model.use_triton_kernels()
    warmed, served = set(), set()
    with recorded_launches(warmed):
        engine.runner.warm_up(24)
    with recorded_launches(served):
        run_engine(engine, make_requests(seed=5))
    assert len(served) > 5 and not served - warmed, sorted(served - warmed)


def test_the_checkpoints_q8_head_on_the_triton_path(tmp_path: Path) -> None:
    """A GGUF's Q8_0 head goes to the Triton INT8 matmul on the GPU path, fp32 logits straight from
    its sums: those of the dense copy (which holds the Q8_0 values exactly) but for the order of
    the sums, at one row (the GEMV) and at many (the GEMM)."""
    import torch.nn.functional as F
    from tiny_models import write_llama_gguf

    from llmd.daemon.loader import load_model
    from llmd.daemon.model_source import resolve_model
    from llmd.kernels.quant_matmul_triton import FusedMatmul
    from llmd.daemon.quantization import QuantConfig

    path = write_llama_gguf(make_hf_model("llama"), tmp_path / "q8.gguf", quantize_type="Q8_0")
    model = load_model(resolve_model(path), quant=QuantConfig("auto")).model
    assert model.head_q8 is not None and model.head_q8.kernel == "native"  # the checkpoint's blocks, kept
    model.attn_backend = TritonAttentionBackend()
    model.use_triton_kernels()
    assert model.head_q8.kernel == "triton" and isinstance(model.head_q8.matmul, FusedMatmul)
    assert model.kernels()["lm_head"] == "Triton int8 (the checkpoint's Q8_0)"
    dense = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
    for rows in (1, 40):
        hidden = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
        got = model.compute_logits(hidden)
        assert got.dtype == torch.float32 and got.shape == (rows, model.config.vocab_size)
        assert (got - F.linear(hidden, dense)).abs().max() < 1e-4


def test_generator_on_the_triton_backend(tmp_path: Path) -> None:
    """The one-sequence Generator (INT4 calibration at load, `llmd bench` perplexity) on the Triton
    backend: its cache is blocks of 16 (one block of the whole prompt was refused), and its logits
    are the torch backend's."""
    from llmd.daemon.reference_generator import Generator

    model_dir = save_hf_model(make_hf_model("qwen2"), tmp_path / "qwen2", with_tokenizer=True)
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    triton_model = make_engine(model_dir, attention=TritonAttentionBackend()).model
    torch_model = make_engine(model_dir, attention=TorchAttentionBackend()).model
    got, want = Generator(triton_model).logits(prompt), Generator(torch_model).logits(prompt)
    assert got.shape == (40, triton_model.config.vocab_size)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_triton_backend_refuses_small_blocks(tmp_path: Path) -> None:
    model_dir = save_hf_model(make_hf_model("qwen2"), tmp_path / "m", with_tokenizer=True)
    with pytest.raises(ValueError, match="need a block size of 16 or 32, got 8; use --attention torch"):
        make_engine(model_dir, attention=TritonAttentionBackend(), num_blocks=8, block_size=8)


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_attention_backend("auto", "cpu"), CpuAttentionBackend)  # the library builds here
    with pytest.raises(ValueError, match="runs on the CPU only"):
        make_attention_backend("cpu", "cuda")
    assert isinstance(make_attention_backend("torch", "cuda"), TorchAttentionBackend)
    assert isinstance(make_attention_backend("triton", "cpu"), TritonAttentionBackend)  # TRITON_INTERPRET=1 here
    with pytest.raises(ValueError, match="one of auto, torch, cpu, triton"):
        make_attention_backend("flash", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # a V100
    assert isinstance(make_attention_backend("auto", "cuda"), TorchAttentionBackend)  # with a warning
    with pytest.raises(ValueError, match="compute capability 7.5 .* this one has 7.0"):
        make_attention_backend("triton", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    assert isinstance(make_attention_backend("auto", "cuda"), TritonAttentionBackend)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="runs on CUDA GPUs"):
        make_attention_backend("triton", "cpu")
