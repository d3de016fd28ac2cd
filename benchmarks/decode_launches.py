"""Kernel launches and host time per decode step on the GPU path, counted on the CPU (no GPU here).

    .venv/bin/python benchmarks/decode_launches.py                  # default model, batch 1 and 16
    .venv/bin/python benchmarks/decode_launches.py --batch 1 8 --steps 32 --detail

The engine runs the default model with the code paths it takes on a GPU: the Triton attention
backend, the Triton INT4/INT8 matmuls on the projections and the dense LM head. Decode steps run
three ways: layer by layer with the norms, RoPE and SiLU as torch operations ("torch ops", as before
issue 19), layer by layer with them as one Triton kernel each ("fused ops"), and the fused decode
step, llmd.kernels.decode_triton, four launches a layer ("fused step", what a GPU runs). Triton runs
in interpreter mode with every kernel launch counted and *not executed* (the numbers are garbage;
only the host side is measured), so a step takes the host's time only. Speculative decoding is off.
`--batch` requests decode greedily; over `--steps` pure decode steps it reports:

  triton     Triton kernel launches per step
  torch      torch operations that launch a CUDA kernel (views, allocations and other
             metadata-only operations excluded)
  copies     host-to-device copies of the step's inputs (DecodeInputs.fill: one per buffer on a
             GPU; none here, so counted from the buffers)
  reads      tensor reads to the host (.tolist/.item/.numpy/.cpu), each a sync on a GPU
  host us    median wall time of engine.step() minus the LM head's matmul and the greedy argmax
             (on a GPU a launch each, here the heavy CPU work): scheduling, inputs, Python between kernels,
             torch's dispatch, sampling, detokenising. It leaves out the launch itself (the CUDA
             driver, Triton's launcher): "est. us" adds --launch-us per launch for that. The
             lowest median of --repeat runs of --steps steps: these machines' noise only adds.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton: kernels become interpretable

import argparse  # noqa: E402
import collections  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# aten operations that launch no kernel on a GPU: views, metadata, allocation without a fill.
NO_KERNEL = {
    "view", "_unsafe_view", "_reshape_alias", "reshape", "slice", "select", "split", "split_with_sizes",
    "chunk", "unbind", "narrow", "expand", "t", "transpose", "permute", "unsqueeze", "squeeze", "as_strided",
    "alias", "detach", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
    "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size", "resolve_conj",
    "resolve_neg",
}
HOST_READS = ("tolist", "item", "numpy", "cpu")


class Counts:
    def __init__(self) -> None:
        self.triton: collections.Counter[str] = collections.Counter()
        self.torch: collections.Counter[str] = collections.Counter()
        self.reads = 0


@contextmanager
def stubbed_triton(counts: Counts | None):
    """Count Triton launches by kernel name (none counted with ``counts=None``, for the timing: the
    count would be host time no GPU spends); run none of them."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup and counts is not None:
            counts.triton[self.fn.__name__] += 1

    InterpretedFunction.run = run
    try:
        yield
    finally:
        InterpretedFunction.run = original


class CountKernels(TorchDispatchMode):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self.counts.torch[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counted_reads(counts: Counts):
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def wrap(fn):
        def read(self, *args, **kwargs):
            counts.reads += 1
            return fn(self, *args, **kwargs)
        return read

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


@contextmanager
def timed_device_work(model, box: list[float]):
    """Add the time of model.compute_logits (the LM head's matmul) and of the greedy sampler's
    argmax to box[0]: on a GPU each is one launch (the argmax's result read back in the step's one
    sync), here the heavy CPU work of a step whose kernels are not run."""
    from llmd.daemon.engine import sampler

    def timed(fn):
        def run(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                box[0] += time.perf_counter() - start
        return run

    head, argmax = model.compute_logits, sampler.argmax_rows
    model.compute_logits, sampler.argmax_rows = timed(head), timed(argmax)
    try:
        yield
    finally:
        del model.compute_logits  # the bound method again
        sampler.argmax_rows = argmax


def measure(llm, batch: int, steps: int, repeat: int) -> dict[str, float]:
    from llmd import SamplingParams

    engine, model = llm.engine, llm.engine.model
    params = SamplingParams(temperature=0, max_tokens=(repeat + 2) * steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}-{time.monotonic_ns()}", llm.encode(f"Request {i}: a long story."), params)
    counts = Counts()
    with stubbed_triton(Counts()):
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                              for s in engine.scheduler.running):
            engine.step()  # prompts done: from here every step decodes `batch` rows
        for _ in range(3):
            engine.step()
    with stubbed_triton(counts), counted_reads(counts), CountKernels(counts):
        for _ in range(steps):
            engine.step()
    medians = []
    box = [0.0]
    with stubbed_triton(None), timed_device_work(model, box):
        for _ in range(repeat):
            host = []
            for _ in range(steps):
                box[0] = 0.0
                start = time.perf_counter()
                engine.step()
                host.append(time.perf_counter() - start - box[0])
            medians.append(statistics.median(host))
    for rid in list(engine.requests):
        engine.abort_request(rid)
    copies = engine.runner.decode_inputs.num_buffers
    return {"triton": counts.triton.total() / steps, "torch": counts.torch.total() / steps, "copies": copies,
            "reads": counts.reads / steps, "host_us": 1e6 * min(medians),
            "by_kernel": {f"triton {k}": v / steps for k, v in counts.triton.items()}
            | {f"torch {k}": v / steps for k, v in counts.torch.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5, help="runs of --steps steps timed; the lowest median")
    parser.add_argument("--dtype", default="bfloat16", help="the activations' dtype (a GPU's: bfloat16)")
    parser.add_argument("--launch-us", type=float, default=4.0,
                        help="host time of one launch in the driver and Triton's launcher, for 'est. us'")
    parser.add_argument("--detail", action="store_true", help="launches per step by kernel")
    args = parser.parse_args()

    from llmd import LLM
    from llmd.daemon.models.layer_ops import TorchLayerOps, TritonLayerOps
    from llmd.kernels import rope_cpu

    # Speculation off: a step that verifies drafts has rows of several tokens, which go layer by
    # layer (the prompt chunks' path); every measured step here is a pure decode step.
    llm = LLM(args.model, device="cpu", dtype=args.dtype, attention="triton", speculative="off")
    model = llm.engine.model
    model.use_triton_kernels()
    rope_cpu.usable = lambda *args: False  # the torch layers' RoPE as on a GPU, not the native CPU kernel
    layers = model.config.num_layers
    print(f"{layers} layers, {args.dtype}; Triton kernels counted, not run; est. us = host us + "
          f"{args.launch_us:g} us x launches")
    print(f"{'batch':>5} {'decode':>10} {'triton':>7} {'torch':>6} {'copies':>6} {'launches':>8} {'/layer':>6} "
          f"{'reads':>5} {'host us':>8} {'est. us':>8}")
    step = model.decode_step
    modes = (("torch ops", TorchLayerOps(), None), ("fused ops", TritonLayerOps(), None),
             ("fused step", TritonLayerOps(), step))
    for batch in args.batch:
        for name, ops, decode_step in modes:
            model.layer_ops, model.decode_step = ops, decode_step
            r = measure(llm, batch, args.steps, args.repeat)
            launches = r["triton"] + r["torch"] + r["copies"]
            print(f"{batch:>5} {name:>10} {r['triton']:>7.0f} {r['torch']:>6.0f} {r['copies']:>6} {launches:>8.0f} "
                  f"{launches / layers:>6.1f} {r['reads']:>5.0f} {r['host_us']:>8.0f} "
                  f"{r['host_us'] + args.launch_us * launches:>8.0f}")
            if args.detail:
                for kernel, n in sorted(r["by_kernel"].items(), key=lambda kv: -kv[1]):
                    print(f"{'':>16}{n:>7.1f}  {kernel}")


if __name__ == "__main__":
    main()
