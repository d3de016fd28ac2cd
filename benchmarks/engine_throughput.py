"""Engine throughput on the default model: N concurrent fixed-length generations through
``llmd.LLM`` (in-process), optionally next to transformers ``generate`` one request at a time.

    .venv/bin/python benchmarks/engine_throughput.py                 # 1, 4, 16, 32 streams
    .venv/bin/python benchmarks/engine_throughput.py --streams 16 --hf

Prints, per concurrency: aggregate output tok/s, mean per-stream decode tok/s, TTFT p50/max.
Each stream gets a different chat prompt and exactly --max-tokens new tokens (ignore_eos).
"""

from __future__ import annotations

import argparse
import statistics
import time

QUESTIONS = [
    "What is the capital of France?", "Name three colours.", "Who wrote Hamlet?", "Why is the sky blue?",
    "Explain gravity.", "What is a prime number?", "Give me a haiku about the sea.", "What does a CPU do?",
]


def prompts_for(llm, n: int) -> list[list[int]]:
    # NOTE: unique per run (the run size is in the text) so no run is served from an earlier one's
    # prefix cache; the system prompt stays shared, as it is for real chat traffic.
    return [llm.apply_chat_template([{"role": "user", "content": f"({n}.{i}) {QUESTIONS[i % len(QUESTIONS)]}"}])
            for i in range(n)]


def run_llmd(llm, n: int, max_tokens: int) -> dict[str, float]:
    from llmd import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = prompts_for(llm, n)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    ttfts = [o.metrics.ttft for o in outs]
    per_stream = [o.metrics.decode_tokens_per_s or 0.0 for o in outs]
    return {
        "streams": n, "aggregate_tok_s": sum(len(o.token_ids) for o in outs) / wall,
        "per_stream_tok_s": statistics.mean(per_stream), "ttft_p50_s": statistics.median(ttfts),
        "ttft_max_s": max(ttfts), "wall_s": wall,
    }


def run_hf(llm, n: int, max_tokens: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    path = llm.source.path
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ttfts, rates = [], []
    start = time.perf_counter()
    total = 0
    for ids in prompts_for(llm, n):
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False)
            ttfts.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False)
        total += out.shape[1] - len(ids)
        rates.append((out.shape[1] - len(ids)) / (time.perf_counter() - t1))
    wall = time.perf_counter() - start
    return {"streams": n, "aggregate_tok_s": total / wall, "per_stream_tok_s": statistics.mean(rates),
            "ttft_p50_s": statistics.median(ttfts), "ttft_max_s": max(ttfts), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument("--dtype", nargs="+", default=["auto"],
                        help="one or more of auto, float32, bfloat16, run one after the other (default: auto)")
    parser.add_argument("--quant", nargs="+", default=["auto"], help="--quant schemes to compare (default: auto)")
    parser.add_argument("--hf", action="store_true", help="also run transformers generate, one request at a time")
    parser.add_argument("--hf-streams", type=int, default=4, help="requests for the transformers run")
    args = parser.parse_args()

    import torch

    from llmd import LLM

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.max_tokens} new tokens per "
          f"stream, max_batched_tokens {args.max_batched_tokens}")
    rows = []
    for dtype in args.dtype:
        for quant in args.quant:
            llm = LLM(max_batched_tokens=args.max_batched_tokens, dtype=dtype, quant=quant)
            run_llmd(llm, 2, 8)  # warm-up
            name = f"llmd {str(llm.engine.model.dtype).removeprefix('torch.')}" + ("" if quant == "none" else f" {quant}")
            rows += [(name, run_llmd(llm, n, args.max_tokens)) for n in args.streams]
    if args.hf:
        rows.append(("transformers", run_hf(llm, args.hf_streams, args.max_tokens)))
    print(f"{'engine':<22}{'streams':>8}{'agg tok/s':>11}{'stream tok/s':>14}{'TTFT p50':>10}{'TTFT max':>10}")
    for name, r in rows:
        print(f"{name:<22}{r['streams']:>8}{r['aggregate_tok_s']:>11.1f}{r['per_stream_tok_s']:>14.1f}"
              f"{r['ttft_p50_s']:>9.2f}s{r['ttft_max_s']:>9.2f}s")


if __name__ == "__main__":
    main()
