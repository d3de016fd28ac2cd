"""What a decode step costs besides its arithmetic: torch operations dispatched and Python time per
step, with the native decode step (one call for all layers) and layer by layer, in one run.

    .venv/bin/python benchmarks/decode_overhead.py                 # batch 1 and 16, default model
    .venv/bin/python benchmarks/decode_overhead.py --batch 1 4 32 --steps 64

The engine (llmd.LLM, default settings) runs `--batch` requests that are all decoding; over
`--steps` steps it counts the torch operations the profiler sees (the native kernels are ctypes
calls, not torch operations) and times each engine.step() (medians over the steps). "native" is the time inside the native
decode step and the quantised matmuls (the LM head, and layer by layer the projections); "Python"
is the rest of the step: scheduling, input tensors, sampling, detokenising, and the torch and
ctypes calls between the kernels (layer by layer that includes attention and RoPE, which run
natively but are not counted as such here).
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

from torch.profiler import ProfilerActivity, profile


@contextmanager
def native_timer(box: list[float]):
    """Add the time spent inside the native decode step and the quantised matmuls to box[0]."""
    from llmd.kernels.decode_cpu import DecodeStep
    from llmd.kernels.quant_cpu import PackedWeight

    originals = {cls: cls.__call__ for cls in (DecodeStep, PackedWeight)}

    def wrap(fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                box[0] += time.perf_counter() - start
        return timed

    for cls, fn in originals.items():
        cls.__call__ = wrap(fn)
    try:
        yield
    finally:
        for cls, fn in originals.items():
            cls.__call__ = fn


def measure(llm, batch: int, steps: int) -> dict[str, float]:
    from llmd import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3 * steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}-{time.monotonic_ns()}", llm.encode(f"Request {i}: tell me a long story."),
                           params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prompts done: from here every step decodes `batch` rows
    for _ in range(4):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    ops = sum(e.count for e in prof.key_averages())
    box = [0.0]
    walls, natives = [], []
    with native_timer(box):
        for _ in range(steps):
            box[0] = 0.0
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
            natives.append(box[0])
    for rid in list(engine.requests):
        engine.abort_request(rid)
    # medians over the steps: these machines are noisy, and Python time is a small difference
    return {"ops": ops / steps, "step_ms": 1e3 * statistics.median(walls),
            "native_ms": 1e3 * statistics.median(natives),
            "python_ms": 1e3 * statistics.median(w - n for w, n in zip(walls, natives))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    from llmd import LLM
    from llmd.bench import kernels_line

    llm = LLM(dtype=args.dtype)
    model = llm.engine.model
    fused = model.decode_step
    print(kernels_line(model.kernels()))
    print(f"{'batch':>5} {'decode':>14} {'torch ops/step':>15} {'step ms':>8} {'native ms':>10} {'Python ms':>10}")
    for batch in args.batch:
        for name, step in (("layer by layer", None), ("native step", fused)):
            if name == "native step" and fused is None:
                continue
            model.decode_step = step
            r = measure(llm, batch, args.steps)
            print(f"{batch:>5} {name:>14} {r['ops']:>15.0f} {r['step_ms']:>8.2f} {r['native_ms']:>10.2f} "
                  f"{r['python_ms']:>10.2f}")
    model.decode_step = fused


if __name__ == "__main__":
    main()
