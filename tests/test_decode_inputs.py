"""Decode steps on persistent input buffers (daemon/engine/decode_inputs.py): what a captured CUDA
graph relies on, checked on the CPU. A step must read nothing but the buffers' contents: run on
buffers refilled for other sequences, with the host-side metadata of the earlier step left stale
(as a graph replay would), it gives those sequences' fresh result; padding rows write no KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_hf_model, save_hf_model

from llmd.daemon.attention import AttentionMetadata, CpuAttentionBackend, TorchAttentionBackend, TritonAttentionBackend
from llmd.daemon.engine.decode_inputs import PAD_SLOT, DecodeInputs
from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.engine.sequence import Sequence
from llmd.daemon.loader import load_model
from llmd.daemon.model_source import resolve_model
from llmd.daemon.models.layer_ops import TritonLayerOps
from llmd.kernels import native
from llmd.daemon.quantization import QuantConfig

BLOCK = 16
NUM_BLOCKS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_hf_model(make_hf_model("qwen2", max_position_embeddings=256), tmp_path_factory.mktemp("di") / "m",
                         with_tokenizer=True)


def sequences(lengths: list[int], first_block: int, seed: int) -> list[Sequence]:
    """Sequences about to decode the token after ``length`` computed ones, on their own blocks."""
    g = torch.Generator().manual_seed(seed)
    seqs, block = [], first_block
    for i, n in enumerate(lengths):
        seq = Sequence(f"s{seed}-{i}", torch.randint(0, 256, (n + 1,), generator=g).tolist(), SamplingParams())
        seq.num_computed_tokens = n
        need = -(-(n + 1) // BLOCK)
        seq.block_ids = list(range(block, block + need))
        block += need
        seqs.append(seq)
    return seqs


def fresh_step(model, seqs: list[Sequence], caches, max_seq_len: int | None = None) -> torch.Tensor:
    """The same step built from scratch (no persistent buffers), as the flat path builds inputs
    (``max_seq_len``: instead of the longest sequence's)."""
    slots = [s.block_ids[s.num_computed_tokens // BLOCK] * BLOCK + s.num_computed_tokens % BLOCK for s in seqs]
    width = max(len(s.block_ids) for s in seqs)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), query_lens=[1] * len(seqs),
                             seq_lens=[s.num_computed_tokens + 1 for s in seqs],
                             block_tables=torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs]))
    if max_seq_len is not None:
        meta.max_seq_len = max_seq_len
    ids = torch.tensor([s.token_ids[s.num_computed_tokens] for s in seqs])
    return model(ids, torch.tensor([s.num_computed_tokens for s in seqs]), caches, meta)


def random_caches(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    shape = (NUM_BLOCKS, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.randn(shape, generator=g).to(model.dtype), torch.randn(shape, generator=g).to(model.dtype))
            for _ in range(cfg.num_layers)]


# (the GPU path runs in Triton's interpreter: the CPU profile does not change it)
@pytest.mark.parametrize("path", ["native step", "layer by layer",
                                  pytest.param("gpu path", marks=pytest.mark.profile_independent)])
def test_a_step_reads_only_its_buffers(model_dir: Path, path: str) -> None:
    """"gpu path": what a CUDA graph captures (Triton attention, the fused layer kernels, the Triton
    INT4 GEMV with split-K), under the interpreter."""
    if path == "native step" and native.library() is None:
        pytest.skip("no native library")
    backend = CpuAttentionBackend() if path == "native step" else TorchAttentionBackend()
    model = load_model(resolve_model(model_dir), quant=QuantConfig("int4"), attention=backend).model
    if path == "gpu path":  # loaded with torch attention: its INT4 calibration is quicker than interpreted
        model.attn_backend, model.layer_ops = TritonAttentionBackend(), TritonLayerOps()
        model.use_triton_kernels()
    assert (model.decode_step is not None) == (path != "layer by layer")  # "gpu path": the fused Triton step
    # padding rows: the native step and Triton's KV write skip their slot; the torch reference's
    # write does not take them (CUDA graphs, which pad, require Triton attention)
    padded = path != "layer by layer"
    inputs = DecodeInputs(max_rows=8, max_blocks=8, block_size=BLOCK, device=torch.device("cpu"), buckets=padded)
    first, second = sequences([5, 40, 17], 0, seed=1), sequences([70, 3, 33], 10, seed=2)

    ids, positions, meta = inputs.fill(first)
    assert ids.shape[0] == (4 if padded else 3)  # three sequences padded to a bucket of four
    caches = random_caches(model, 0)
    # Triton's decode attention picks its split count from max_seq_len on the host: a graph is
    # captured with the model's longest context (DecodeGraphs), and so is every step here.
    fixed_max = 256 if path == "gpu path" else None
    if fixed_max:
        meta.max_seq_len = fixed_max
    model(ids, positions, caches, meta)  # the "capture": first's step
    stale = (list(meta.seq_lens), meta.max_seq_len)

    again = inputs.fill(second)
    assert all(a is b for a, b in zip(again, (ids, positions, meta)))  # the same objects: what a graph holds
    meta.seq_lens, meta.max_seq_len = stale  # a replay sees the capture's host-side values
    before = [(k.clone(), v.clone()) for k, v in caches]
    reference_caches = [(k.clone(), v.clone()) for k, v in caches]
    replayed = model(ids, positions, caches, meta)[:3]
    fresh = fresh_step(model, second, reference_caches, fixed_max)
    assert torch.equal(replayed, fresh)
    for (k, v), (k0, v0), (kr, vr) in zip(caches, before, reference_caches):
        assert torch.equal(k, kr) and torch.equal(v, vr)  # the same KV written, the padding row's none
        assert not torch.equal(k, k0)  # (something was written)


def test_padding_rows_and_buckets() -> None:
    inputs = DecodeInputs(max_rows=6, max_blocks=4, block_size=BLOCK, device=torch.device("cpu"), buckets=True)
    assert [inputs.rows_for(n) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]
    with pytest.raises(ValueError, match="1..6"):
        inputs.rows_for(7)
    _, _, meta = inputs.fill(sequences([3, 20, 9], 0, seed=3))
    assert meta.slot_mapping.tolist()[3] == PAD_SLOT and meta.seq_lens_tensor.tolist()[3] == 1
    assert meta.seq_lens == [4, 21, 10, 1] and meta.max_seq_len == 21
    unpadded = DecodeInputs(max_rows=6, max_blocks=4, block_size=BLOCK, device=torch.device("cpu"))
    assert unpadded.fill(sequences([3, 20, 9], 0, seed=3))[0].shape[0] == 3
