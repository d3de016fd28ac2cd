"""Daemon throughput: N concurrent streaming clients through the socket, next to the same
workload in-process, to show what the protocol costs.

    .venv/bin/python benchmarks/daemon_throughput.py                      # 1, 16, 32 clients
    .venv/bin/python benchmarks/daemon_throughput.py --clients 16 --max-tokens 64

It starts its own daemon (default model, --dtype as given) in a temporary runtime dir and stops
it at the end. Clients run as asyncio tasks of one AsyncClient in this process. Daemon and
in-process runs alternate (the idle one sleeps), --repeat times each; the best of each is shown,
since these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Who wrote Hamlet?", "Why is the sky blue?"]


def messages(run: str, i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"({run}.{i}) {QUESTIONS[i % len(QUESTIONS)]}"}]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def one(client, run: str, i: int, max_tokens: int) -> tuple[float, int]:
    from llmd.client import Result

    start = time.perf_counter()
    ttft, n = None, 0
    async for item in client.chat(messages(run, i), max_tokens=max_tokens, temperature=0, ignore_eos=True):
        if isinstance(item, Result):
            break
        if ttft is None and item.token_ids:
            ttft = time.perf_counter() - start
        n += len(item.token_ids)
    return ttft or 0.0, n


async def run_clients(socket_dir: Path, n: int, max_tokens: int) -> dict[str, float]:
    from llmd.client import AsyncClient

    async with AsyncClient(socket_dir) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, f"d{n}", i, max_tokens) for i in range(n)))
        wall = time.perf_counter() - start
    ttfts = [r[0] for r in results]
    return {"n": n, "tok_s": sum(r[1] for r in results) / wall, "p50": statistics.median(ttfts), "p99": pct(ttfts, 0.99)}


def run_in_process(llm, n: int, max_tokens: int) -> dict[str, float]:
    from llmd import SamplingParams

    prompts = [llm.apply_chat_template(messages(f"i{n}", i)) for i in range(n)]
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    wall = time.perf_counter() - start
    ttfts = [o.metrics.ttft for o in outs]
    return {"n": n, "tok_s": sum(len(o.token_ids) for o in outs) / wall, "p50": statistics.median(ttfts),
            "p99": pct(ttfts, 0.99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    from llmd import LLM

    llm = LLM(dtype=args.dtype)
    run_in_process(llm, 2, 8)  # warm-up
    daemon_rows, local_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        socket_dir = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "llmd", "start", "--socket-dir", str(socket_dir), "--dtype", args.dtype],
                       check=True)
        try:
            asyncio.run(run_clients(socket_dir, 2, 8))  # warm-up
            for n in args.clients:
                d, i = [], []
                for _ in range(args.repeat):
                    d.append(asyncio.run(run_clients(socket_dir, n, args.max_tokens)))
                    i.append(run_in_process(llm, n, args.max_tokens))
                daemon_rows.append(max(d, key=lambda r: r["tok_s"]))
                local_rows.append(max(i, key=lambda r: r["tok_s"]))
        finally:
            subprocess.run([sys.executable, "-m", "llmd", "stop", "--socket-dir", str(socket_dir)], check=False)
    print(f"{args.max_tokens} new tokens per stream, dtype {args.dtype}")
    print(f"{'clients':>8}{'daemon tok/s':>14}{'in-proc tok/s':>15}{'ratio':>7}{'TTFT p50 d/i':>16}{'TTFT p99 d/i':>16}")
    for d, i in zip(daemon_rows, local_rows):
        print(f"{d['n']:>8}{d['tok_s']:>14.1f}{i['tok_s']:>15.1f}{d['tok_s'] / i['tok_s']:>7.2f}"
              f"{d['p50']:>8.2f}/{i['p50']:.2f}s{d['p99']:>9.2f}/{i['p99']:.2f}s")


if __name__ == "__main__":
    main()
