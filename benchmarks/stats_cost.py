"""What the live view costs: decode throughput of 16 concurrent streaming clients with `llmd chat`
attached (a real ChatApp, headless, in its own process, drawing the dashboard from the published
stats) and without, alternating; plus the daemon-side cost of one stats message (block map, request
table, msgpack) measured directly.

    .venv/bin/python benchmarks/stats_cost.py                  # default model, 16 clients x 128 tokens
    .venv/bin/python benchmarks/stats_cost.py --repeat 5

It starts its own daemon in a temporary runtime dir and stops it at the end.
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

import psutil

HEADLESS_UI = """
import asyncio, sys
from pathlib import Path
from llmd.client import AsyncClient, load_connection
from llmd.tui.app import ChatApp
from llmd.tui.conversation import ConversationStore

async def main():
    async with AsyncClient(connection=load_connection(sys.argv[1])) as client:
        app = ChatApp(client, ConversationStore(Path(sys.argv[2])))
        async with app.run_test(size=(160, 48)) as pilot:  # headless, renders every update
            print("ready", flush=True)
            while True:
                await pilot.pause(1.0)
asyncio.run(main())
"""


async def one(client, i: int, max_tokens: int) -> int:
    from llmd.client import Result

    n = 0
    async for item in client.chat([{"role": "user", "content": f"({i}) Tell me about the sea."}],
                                  max_tokens=max_tokens, temperature=0, ignore_eos=True):
        if isinstance(item, Result):
            break
        n += len(item.token_ids)
    return n


async def run_clients(socket_dir: Path, n: int, max_tokens: int) -> float:
    from llmd.client import AsyncClient

    async with AsyncClient(socket_dir) as client:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, i, max_tokens) for i in range(n)))
        return sum(tokens) / (time.perf_counter() - start)


def publish_cost(n_seqs: int = 16, calls: int = 200) -> tuple[float, int]:
    """Seconds per stats message and its bytes, with n_seqs running on the default model's pool."""
    from llmd import LLM
    from llmd.daemon.engine.sampling_params import SamplingParams
    from llmd.protocol import encode

    llm = LLM()
    engine = llm.engine
    for i in range(n_seqs):
        engine.add_request(f"r{i}", llm.encode(f"({i}) Tell me about the sea. " * 8), SamplingParams(max_tokens=64))
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(calls):
        blocks, rows = engine.live_view()
        content = {**engine.stats().to_dict(), "block_map": blocks, "requests": [r.to_dict() for r in rows]}
        frames = encode(b"k" * 32, "stats", content)
    return (time.perf_counter() - start) / calls, sum(len(f) for f in frames)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    per_message, size = publish_cost()
    with tempfile.TemporaryDirectory() as tmp:
        socket_dir = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "llmd", "start", "--socket-dir", str(socket_dir)], check=True)
        try:
            asyncio.run(run_clients(socket_dir, 2, 8))  # warm-up
            without, with_ui, ui_cpu = [], [], []
            for _ in range(args.repeat):
                without.append(asyncio.run(run_clients(socket_dir, args.clients, args.max_tokens)))
                ui = subprocess.Popen([sys.executable, "-c", HEADLESS_UI, str(socket_dir), str(Path(tmp) / "chats")],
                                      stdout=subprocess.PIPE, text=True)
                if ui.stdout.readline().strip() != "ready":
                    raise RuntimeError("the headless chat UI did not start")
                time.sleep(1.0)
                cpu = psutil.Process(ui.pid)
                before, start = sum(cpu.cpu_times()[:2]), time.perf_counter()
                with_ui.append(asyncio.run(run_clients(socket_dir, args.clients, args.max_tokens)))
                ui_cpu.append((sum(cpu.cpu_times()[:2]) - before) / (time.perf_counter() - start))
                ui.terminate()
                ui.wait()
        finally:
            subprocess.run([sys.executable, "-m", "llmd", "stop", "--socket-dir", str(socket_dir)], check=False)
    print(f"{args.clients} clients x {args.max_tokens} tokens, {args.repeat} alternating runs each (tok/s)")
    print(f"  without UI: {', '.join(f'{x:.1f}' for x in without)}   median {statistics.median(without):.1f}")
    print(f"  with UI:    {', '.join(f'{x:.1f}' for x in with_ui)}   median {statistics.median(with_ui):.1f}")
    print(f"  UI attached / not: {statistics.median(with_ui) / statistics.median(without):.3f}")
    print(f"  the UI process used {100 * statistics.median(ui_cpu):.1f}% of one core meanwhile (median)")
    print(f"daemon side: one stats message with block map + request table = {1000 * per_message:.3f} ms, "
          f"{size} bytes; at 4 per second {100 * 4 * per_message:.2f}% of the daemon's time")


if __name__ == "__main__":
    main()
