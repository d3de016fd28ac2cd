"""The int8 KV cache against the model's own (issue 23): capacity, quality and speed, in one run.

    .venv/bin/python benchmarks/kv_cache_int8.py                      # all three
    .venv/bin/python benchmarks/kv_cache_int8.py --only quality --chats 12
    .venv/bin/python benchmarks/kv_cache_int8.py --only speed --rounds 3
    .venv/bin/python benchmarks/kv_cache_int8.py --only step          # the decode step alone, paired

* capacity: the blocks and tokens the default model's KV pool holds in the same ``--kv-cache-mb``
  (1 GiB: what the default CPU pool's prefix cache keeps resident) with each cache dtype.
* quality, in this process: the perplexity of the shipped held-out text (tests/data/richard_iii.txt,
  windows of ``--window`` tokens: every token sees up to that much context) on the served path
  (``--dtype auto``: its cache is bf16 where the CPU has bf16, else fp32) and on the fp32 reference
  path (dense fp32 weights, torch attention), each with its own cache and with an int8 one; then
  ``--chats`` chat prompts answered greedily on the fp32 reference path with both caches: how many
  agree on their first 16 tokens, and the mean position of the first token that differs (``--max-tokens``
  when none does).
* speed: two daemons, ``--kv-cache-dtype auto`` and ``int8``, the same ``llmd bench`` loads in turn
  (which goes first alternates), ``--rounds`` rounds: 16 streams of 1,024-token prompts and 128 new
  tokens (the issue's load: long contexts), the same with 128-token prompts (short contexts), and one
  stream of 1,024. Reported: output tok/s of each (the median of the rounds) and the median of each
  round's paired ratio int8 / auto with its range. The ratio is the figure to quote.
* step, in this process: the fused native decode step alone (what a decode step costs without the
  prefill, sampling and the daemon that the loads above include), 16 rows at contexts of 16, 200 and
  1,024 tokens over caches of random values, both engines' steps timed in turn, the median of each
  pair's ratio. These machines drift by tens of per cent within minutes; a pair is milliseconds apart.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from llmd.kernels import cpu_profile

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "richard_iii.txt"
CHATS = ["What is the capital of France? Answer in one sentence.", "Write a short poem about the sea.",
         "Explain what a hash table is.", "Give me three tips for learning to cook.", "Why is the sky blue?",
         "Describe a cat to someone who has never seen one.", "What should I pack for a weekend of hiking?",
         "Tell me a story about a lost key.", "How do vaccines work?", "Summarise the plot of Hamlet.",
         "What is the difference between weather and climate?", "Write a haiku about autumn.",
         "How does a bicycle stay upright?", "Give me a recipe for pancakes."]
LOADS = [("long", 16, 1024), ("short", 16, 128), ("one", 1, 1024)]  # name, streams, prompt tokens


def capacity() -> None:
    import torch

    from llmd.daemon.engine.model_runner import kv_block_bytes
    from llmd.daemon.engine_args import EngineArgs

    resolved = EngineArgs().resolve()
    model = resolved.load_model().model
    budget = 1024 * 2**20
    print(f"capacity: the default model's KV pool in {budget >> 20} MiB (blocks of 16 tokens)")
    blocks = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
        blocks[dtype] = budget // kv_block_bytes(model, 16, dtype)
        print(f"  {str(dtype)[6:]:<9} {blocks[dtype]:>6} blocks, {16 * blocks[dtype]:>7} tokens, "
              f"{kv_block_bytes(model, 16, dtype) / 16 / 1024:.1f} KiB per token")
    print(f"  int8 / bf16: {blocks[torch.int8] / blocks[torch.bfloat16]:.2f}x the tokens; "
          f"int8 / fp32: {blocks[torch.int8] / blocks[torch.float32]:.2f}x")


def quality(window: int, chats: int, max_tokens: int) -> None:
    from llmd import LLM, SamplingParams, perplexity

    text = perplexity.read_text(TEXT)
    print(f"quality: perplexity of {TEXT.name} in windows of {window} tokens")
    for name, kwargs in (("served (--dtype auto)", {}),
                         ("fp32 reference", dict(quant="none", dtype="float32", attention="torch"))):
        ppl, own = {}, ""
        for cache in ("auto", "int8"):
            llm = LLM(kv_cache_dtype=cache, **kwargs)
            ppl[cache] = perplexity.measure_in_process(llm, text, window=window)
            own = own or str(llm.engine.cache_dtype)[6:]  # the model's own cache: auto's
            del llm
        print(f"  {name:<22} {own} cache {ppl['auto'].perplexity:.4f}, int8 cache {ppl['int8'].perplexity:.4f}: "
              f"{100 * (ppl['int8'].perplexity / ppl['auto'].perplexity - 1):+.2f}% "
              f"({ppl['auto'].num_tokens} tokens scored)")
    prompts = [[{"role": "user", "content": q}] for q in CHATS[:chats]]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = {}
    for cache in ("auto", "int8"):
        llm = LLM(quant="none", dtype="float32", attention="torch", kv_cache_dtype=cache)
        outs[cache] = [list(o.token_ids) for o in llm.chat(prompts, params)]
        del llm
    firsts = []
    for a, b in zip(outs["auto"], outs["int8"]):
        firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                           max_tokens if len(a) == len(b) else min(len(a), len(b))))
    agree = sum(f >= 16 for f in firsts)
    print(f"  greedy chats, fp32 reference path, int8 cache against fp32: {agree} of {len(firsts)} agree on their "
          f"first 16 tokens; first difference at {statistics.mean(firsts):.1f} on average (of {max_tokens}): "
          f"{firsts}")


def speed(rounds: int, output_tokens: int) -> None:
    from llmd.bench import BenchConfig, run_bench
    from llmd.client import load_connection

    tmp = tempfile.TemporaryDirectory()
    llmd = [sys.executable, "-m", "llmd"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMD_KV_CACHE")}
    modes = ("auto", "int8")
    dirs = {m: Path(tmp.name) / m for m in modes}
    rates: dict[str, dict[str, list[float]]] = {name: {m: [] for m in modes} for name, _, _ in LOADS}
    try:
        for mode, socket_dir in dirs.items():
            subprocess.run([*llmd, "start", "--socket-dir", str(socket_dir), "--kv-cache-dtype", mode], check=True,
                           env=env)
        connections = {m: load_connection(d) for m, d in dirs.items()}
        for mode in modes:  # first-call costs out of the figures
            asyncio.run(run_bench(connections[mode], BenchConfig(num_streams=2, prompt_tokens=16, output_tokens=8)))
        for rnd in range(rounds):
            for name, streams, prompt in LOADS:
                for mode in modes if rnd % 2 == 0 else modes[::-1]:
                    config = BenchConfig(num_streams=streams, prompt_tokens=prompt, output_tokens=output_tokens,
                                         seed=1000 * rnd + streams)
                    report = asyncio.run(run_bench(connections[mode], config)).report
                    if report.num_failed:
                        raise RuntimeError(f"{report.num_failed} requests failed: {report.errors}")
                    rates[name][mode].append(report.output_tokens_per_s)
                print(f"  round {rnd + 1} {name}: " + ", ".join(f"{m} {rates[name][m][-1]:.1f} tok/s" for m in modes),
                      file=sys.stderr)
    finally:
        for socket_dir in dirs.values():
            subprocess.run([*llmd, "stop", "--socket-dir", str(socket_dir)], check=False, capture_output=True, env=env)
        tmp.cleanup()
    print(f"speed: llmd bench, {output_tokens} new tokens per request, median of {rounds} rounds")
    print(f"  {'load':<28} | {'auto tok/s':>10} {'int8 tok/s':>10} | {'int8/auto':>9} {'range':>11}")
    for name, streams, prompt in LOADS:
        r = rates[name]
        ratios = sorted(b / a for a, b in zip(r["auto"], r["int8"]))
        print(f"  {f'{streams} streams x {prompt}-token prompts':<28} | {statistics.median(r['auto']):>10.1f} "
              f"{statistics.median(r['int8']):>10.1f} | {statistics.median(ratios):>8.2f}x "
              f"{ratios[0]:>5.2f}-{ratios[-1]:.2f}")


def step(rows: int, repeats: int) -> None:
    import time

    import torch

    from llmd import LLM
    from llmd.kernels.kv_format import quantize_rows

    engines = {}
    for cache in ("auto", "int8"):
        # 1 GiB pools: filled whole below (the default reserves more than it writes)
        engine = LLM(kv_cache_dtype=cache, kv_cache_mb=1024).engine
        for k, v in engine.runner.kv_caches:  # plausible values: attention's arithmetic is value-blind
            if k.dtype == torch.int8:
                k.copy_(quantize_rows(torch.randn(*k.shape[:-1], k.shape[-1] - 2)))
                v.copy_(quantize_rows(torch.randn(*v.shape[:-1], v.shape[-1] - 2)))
            else:
                k.normal_()
                v.normal_()
        engines[cache] = engine
    bs = engines["auto"].config.block_size
    print(f"step: the fused native decode step, {rows} rows, median of {repeats} paired timings")
    for ctx in (16, 200, 1024):
        width = -(-(ctx + 1) // bs)
        tables = torch.stack([torch.arange(1, width + 1) + i * width for i in range(rows)]).long()
        lens = torch.full((rows,), ctx + 1, dtype=torch.int32)
        positions = (lens - 1).long()
        slots = tables[torch.arange(rows), positions // bs] * bs + positions % bs
        x = torch.randn(rows, engines["auto"].model.config.hidden_size) * 0.1
        times: dict[str, list[float]] = {c: [] for c in engines}
        for _ in range(repeats + 2):
            for cache, engine in engines.items():
                start = time.perf_counter()
                engine.model.decode_step(x.clone(), positions, slots, tables, lens)
                times[cache].append(time.perf_counter() - start)
        ratios = sorted(a / b for a, b in zip(times["auto"][2:], times["int8"][2:]))
        own, int8 = (1e3 * statistics.median(times[c][2:]) for c in ("auto", "int8"))
        print(f"  context {ctx:>5}: {str(engines['auto'].cache_dtype)[6:]} {own:6.1f} ms, int8 {int8:6.1f} ms: "
              f"int8 {statistics.median(ratios):.2f}x as fast ({ratios[0]:.2f}-{ratios[-1]:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["capacity", "quality", "speed", "step"], default=None)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64, help="quality: tokens per chat answer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=128, help="speed: new tokens per request")
    args = parser.parse_args()
    random.seed(0)
    print(cpu_profile.machine_line())
    if args.only in (None, "capacity"):
        capacity()
    if args.only in (None, "quality"):
        quality(args.window, args.chats, args.max_tokens)
    if args.only in (None, "step"):
        step(16, 10)
    if args.only in (None, "speed"):
        speed(args.rounds, args.output_tokens)


if __name__ == "__main__":
    main()
