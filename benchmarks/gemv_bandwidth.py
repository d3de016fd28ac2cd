"""How close the one-row matmuls (a decode step of one sequence) come to the machine's memory
bandwidth: the native INT4 kernel on one large weight (64 MiB: the kernel alone), over all of the
default model's projections (63 MiB, more than any L3 here, read in the order a decode step reads
them: 120 small calls) and the INT8 LM head (29 MiB: within a 32 MiB L3 it reads faster than memory), each call
on its own and inside the default model's one-call decode step (one sequence, a 16-token context,
so the weights are nearly all it reads), against a plain streaming read of a 1 GiB buffer by as
many threads, in one run.

    .venv/bin/python benchmarks/gemv_bandwidth.py

Weights are random (the kernels' speed does not depend on values); activations are quantised once,
outside the timing (the decode step quantises each input once too). Best of --repeat.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from llmd.kernels import cpu_profile, native
from llmd.kernels.quant_cpu import PackedWeight, quantize_activations
from llmd.quant.int4 import quantize_int4
from llmd.quant.int8 import quantize_int8

# SmolLM2-135M: 30 layers of (out, in)
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def read_bandwidth(repeat: int) -> float:
    """GB/s of a multi-threaded streaming read (torch's fp32 sum: vectorised, on every thread; its
    int32 sum is not)."""
    buf = torch.ones(2**28)  # 1 GiB
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def gemv_bandwidth(weights: list[PackedWeight], lib: ctypes.CDLL, repeat: int) -> float:
    """GB/s of weight bytes through the native kernels at one row, calls back to back."""
    calls = []
    for w in weights:
        xq, xd, xm = quantize_activations(torch.randn(1, w.k))
        out = torch.empty(1, w.n)
        calls.append((w.kind, xq.data_ptr(), xd.data_ptr(), xm.data_ptr(), 1, w.k, w.w.data_ptr(),
                      w.scales.data_ptr(), 0 if w.mins is None else w.mins.data_ptr(), w.n, w.group_size,
                      out.data_ptr(), torch.get_num_threads()))
        calls[-1] = (calls[-1], (xq, xd, xm, out))  # keep the buffers alive
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for args, _ in calls:
            lib.llmd_qgemm_q8(*args)
        best = min(best, time.perf_counter() - start)
    return sum(w.nbytes for w in weights) / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    lib = native.library()
    if lib is None:
        raise SystemExit("the native library could not be built")
    torch.manual_seed(0)
    projections = [PackedWeight.from_int4(quantize_int4(torch.randn(n, k) * 0.02, 32)) for _ in range(30)
                   for n, k in LAYER]
    head = [PackedWeight.from_int8(quantize_int8(torch.randn(49152, 576) * 0.02, 32))]
    large = [PackedWeight.from_int4(quantize_int4(torch.randn(16384, 8192) * 0.02, 32))]
    memory = read_bandwidth(args.repeat)
    one = gemv_bandwidth(large, lib, args.repeat)
    int4 = gemv_bandwidth(projections, lib, args.repeat)
    int8 = gemv_bandwidth(head, lib, args.repeat)
    print(f"CPU profile {cpu_profile.describe()}, {torch.get_num_threads()} threads")
    print(f"streaming read           {memory:6.1f} GB/s")
    print(f"one int4 weight (1 row)  {one:6.1f} GB/s  {one / memory:5.0%} of the read bandwidth "
          f"({large[0].nbytes / 2**20:.0f} MiB)")
    print(f"int4 projections (1 row) {int4:6.1f} GB/s  {int4 / memory:5.0%} of the read bandwidth "
          f"({sum(w.nbytes for w in projections) / 2**20:.0f} MiB)")
    print(f"int8 LM head (1 row)     {int8:6.1f} GB/s  {int8 / memory:5.0%} of the read bandwidth "
          f"({head[0].nbytes / 2**20:.0f} MiB)")
    step = decode_step_bandwidth(args.repeat)
    print(f"decode step (1 row)      {step:6.1f} GB/s  {step / memory:5.0%} of the read bandwidth "
          "(the default model's projection bytes over the whole step)")


def decode_step_bandwidth(repeat: int) -> float:
    """The default model's projection bytes over the time of its native decode step at one row."""
    from llmd import LLM, SamplingParams

    llm = LLM()
    model = llm.engine.model
    if model.decode_step is None:
        raise SystemExit("the default model does not take the native decode step here")
    weights = sum(getattr(m, "native").nbytes for m in model.modules() if getattr(m, "native", None) is not None)
    llm.generate([[1] * 15], SamplingParams(max_tokens=1))  # a 16-token context in blocks 0 and 1
    from llmd.daemon.attention import AttentionMetadata

    meta = AttentionMetadata(slot_mapping=torch.tensor([15]), query_lens=[1], seq_lens=[16],
                             block_tables=torch.tensor([[0, 1]]))
    ids, pos = torch.tensor([1]), torch.tensor([15])
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        model(ids, pos, llm.engine.runner.kv_caches, meta)
        best = min(best, time.perf_counter() - start)
    return weights / best / 1e9


if __name__ == "__main__":
    main()
